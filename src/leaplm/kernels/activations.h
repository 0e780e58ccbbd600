// Activation quantization: x [T, K] fp32 row-major (T <= 32 tokens) -> int8 per token and per block of 32 along
// K (round half to even, scale a = amax / 127), with the per-block sums the block products need. Writes Act:
//   token-major  qa [T, K] int8, a [T, G] fp32, sa [T, G] = a * sum(qa), sq [T, G] int32, sq16 [T, G] int32
//   block-major  qab [G, T, 32] int8, ab [G, T], sqb [G, T], sqb16 [G, T]: the copy the AVX-512 pairs of row groups and the AMX
//                tiles read (a block's tokens at fixed offsets from one pointer; an AMX A tile is [tokens, 32])
#pragma once

#include "common.h"
#include "timers.h"

namespace {

// The activations of one call, quantized: qa [T, K] int8; a, sa [T, G] fp32 (sa = a * sum of the block's qa);
// sq [T, G] int32 (sum of the block's qa); sq16 [T, G] int32 (sum of its first 16 qa).
// The AVX-512 path reads the same values block-major (qab [G, T, 32], ab [G, T], sqb, sqb16 [G, T]): the tokens of one
// block at fixed offsets from one pointer.
struct Act {
  std::vector<int8_t> qa;
  std::vector<float> a, sa;
  std::vector<int32_t> sq, sq16;
  std::vector<int8_t> qab;
  std::vector<float> ab;
  std::vector<int32_t> sqb, sqb16;
  int T;
  int64_t K;
  int G;
};

// out's arrays sized for T tokens of K (both: the block-major copy too)
inline void size_act(Act& out, int T, int64_t K, bool both) {
  const int G = int(K / QK);
  out.T = T, out.K = K, out.G = G;
  out.qa.resize(size_t(T) * K);
  out.a.resize(size_t(T) * G);
  out.sa.resize(size_t(T) * G);
  out.sq.resize(size_t(T) * G);
  out.sq16.resize(size_t(T) * G);
  if (both) {
    out.qab.resize(size_t(T) * K);
    out.ab.resize(size_t(T) * G);
    out.sqb.resize(size_t(T) * G);
    out.sqb16.resize(size_t(T) * G);
  }
}

LEAPLM_INLINE void quantize_act_body(const float* x, int T, int64_t K, Act& out) {
  const int G = int(K / QK);
  size_act(out, T, K, false);
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) {
      const float* xb = x + t * K + g * QK;
      float lanes[8] = {};                                 // |x| max in 8 lanes (max is exact in any order)
      for (int j = 0; j < QK; ++j) lanes[j % 8] = std::max(lanes[j % 8], std::fabs(xb[j]));
      float amax = 0.f;
      for (int l = 0; l < 8; ++l) amax = std::max(amax, lanes[l]);
      const float a = amax / 127.f;
      const float inv = a > 0.f ? 1.f / a : 0.f;
      int8_t* qb = out.qa.data() + t * K + g * QK;
      int32_t q[QK];
      for (int j = 0; j < QK; ++j) {
        // round half to even by the fp32 magic number 1.5 * 2^23 (exact for |v| < 2^22; |v| <= 127.5 here)
        float v = std::min(127.f, std::max(-127.f, xb[j] * inv));
        v = (v + 12582912.f) - 12582912.f;
        q[j] = int32_t(v);
      }
      int sum = 0, sum16 = 0;
      for (int j = 0; j < QK; ++j) {
        qb[j] = int8_t(q[j]);
        sum += q[j];
        if (j == 15) sum16 = sum;
      }
      out.a[t * G + g] = a;
      out.sq[t * G + g] = sum;
      out.sq16[t * G + g] = sum16;
      out.sa[t * G + g] = a * float(sum);
    }
}

// The element-wise and reduction code outside the dot-product kernels is plain C++ in a fixed order, built twice:
// for the baseline instruction set and with AVX2 enabled (wider vectors, no FMA contraction: the same operations,
// so the same bits); the AVX2 build runs where the kernel's AVX2 or VNNI path was chosen. The activation
// quantization's AVX2 form is written out in intrinsics (quantize_act_simd), the same operations per element.
void quantize_act_base(const float* x, int T, int64_t K, Act& out) { quantize_act_body(x, T, K, out); }

#if defined(__x86_64__)
// The same operations as quantize_act_body, 8 lanes at a time: |x| max per lane (lane l holds elements l, l + 8,
// l + 16, l + 24, as the body's lanes[j % 8]), the max over lanes, the scale, then clamp, round by the magic number
// and convert per element (vmaxps/vminps with the constant second pick it for NaN, as std::max/min do).
// On the calling thread: split across the kernel's threads, the 121 calls of a SmolLM2 forward took longer (8
// tokens: 1.10 against 0.49 ms a forward), the pool's hand-offs costing more than the work they share.
__attribute__((target("avx2,f16c"))) void quantize_act_simd(const float* x, int T, int64_t K, Act& out, bool both) {
  const int G = int(K / QK);
  size_act(out, T, K, both);
  const __m256 sign = _mm256_set1_ps(-0.f), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f),
               magic = _mm256_set1_ps(12582912.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) {
      const float* xb = x + t * K + g * QK;
      __m256 v[4];
      for (int c = 0; c < 4; ++c) v[c] = _mm256_loadu_ps(xb + 8 * c);
      // |x| max per lane from 0 (vmaxps returns its second operand when the first is NaN: a NaN is dropped, as
      // the body drops it), then over the lanes (never NaN; a max is exact in any order)
      __m256 m8 = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) m8 = _mm256_max_ps(_mm256_andnot_ps(sign, v[c]), m8);
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float amax = _mm_cvtss_f32(m4);
      const float a = amax / 127.f;
      const __m256 inv = _mm256_set1_ps(a > 0.f ? 1.f / a : 0.f);
      __m256i q[4];
      for (int c = 0; c < 4; ++c) {
        __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[c], inv), lo), hi);
        y = _mm256_sub_ps(_mm256_add_ps(y, magic), magic);
        q[c] = _mm256_cvttps_epi32(y);
      }
      // int32 -> int8 in element order: packs interleave 128-bit lanes, the permute restores the order
      const __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qa.data() + t * K + g * QK), b);
      // the integer sums (exact in any order): of elements 0 .. 15, and of all 32
      const __m256i h8 = _mm256_add_epi32(q[0], q[1]);
      const __m256i s8 = _mm256_add_epi32(h8, _mm256_add_epi32(q[2], q[3]));
      __m128i hs = _mm_add_epi32(_mm256_castsi256_si128(h8), _mm256_extracti128_si256(h8, 1));
      __m128i ss = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      hs = _mm_add_epi32(hs, _mm_shuffle_epi32(hs, 0x4E));
      ss = _mm_add_epi32(ss, _mm_shuffle_epi32(ss, 0x4E));
      hs = _mm_add_epi32(hs, _mm_shuffle_epi32(hs, 0xB1));
      ss = _mm_add_epi32(ss, _mm_shuffle_epi32(ss, 0xB1));
      const int s = _mm_cvtsi128_si32(ss), h = _mm_cvtsi128_si32(hs);
      out.a[t * G + g] = a;
      out.sq[t * G + g] = s;
      out.sq16[t * G + g] = h;
      out.sa[t * G + g] = a * float(s);
      if (both) {                          // the block-major copy the pairs of row groups read
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qab.data() + (size_t(g) * T + t) * QK), b);
        out.ab[g * T + t] = a;
        out.sqb[g * T + t] = s;
        out.sqb16[g * T + t] = h;
      }
    }
}

#endif

void quantize_act(const float* x, int T, int64_t K, Act& out, int path = 0) {
  Span span(R_QUANT);
#if defined(__x86_64__)
  if (path > 0) {
    // the block-major copy: read by the pairs of row groups and the tile products alone
    quantize_act_simd(x, T, K, out, (path >= AVX512VNNI && T >= PAIR_MIN_T) || (path == AMX && (amx_for(false, T) || amx_for(true, T))));
    return;
  }
#endif
  quantize_act_base(x, T, K, out);
}

}  // namespace

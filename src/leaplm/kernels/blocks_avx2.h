// Block products in 8-lane vectors, one row group at a time (the AVX2 path; the VNNI path's single groups reuse the
// same loads, group bodies and stores with its own dot product). Lane r of every vector is row 8 grp + r:
//   weights  block g of group grp at q + (grp G + g) * block bytes, unpacked by load_block to 8 vectors u[c]
//            (chunk c = elements 4c .. 4c+3 of the 8 rows; int4: low nibbles in u[0..3], high in u[4..7])
//   scales   8 per block at (grp G + g) * 8 (int6: 16, the half blocks' 8 and 8)
//   tokens   token-major activations (qa [T, K], a/sa/sq/sq16 [T, G]); partial sums in accp [TT, 8] fp32
#pragma once

#include "activations.h"
#include "common.h"

#if defined(__x86_64__)
namespace {

// ---- SIMD paths: lane r of every vector is row 8 grp + r ------------------------------------------------------
// The weights of block g as 8 vectors of unsigned bytes, vector c holding elements 4c .. 4c+3 of the 8 rows
// (int8: the signed bytes as stored, + 128 by the caller, corrected by 128 * sum(qa) after the dot product; int4: the
// nibbles as stored; int6: the signed integers + 128, from the 6-bit layout).
__attribute__((target("avx2,fma,f16c"))) inline void load_block(const W& w, const uint8_t* b, __m256i* u) {
  if (w.int4 || w.half) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * c));
      u[c] = _mm256_and_si256(v, nib);
      u[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    }
    if (w.half) {
      // chunk 4h + k's top 2 bits at bits 2k, 2k + 1 of vector h: moved to bits 4, 5 (16-bit shifts; the mask
      // keeps only bits that came from the same byte), then u6 + 96 = q + 128
      const __m256i top = _mm256_set1_epi8(0x30), k96 = _mm256_set1_epi8(96);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
        const __m256i t[4] = {_mm256_slli_epi16(v, 4), _mm256_slli_epi16(v, 2), v, _mm256_srli_epi16(v, 2)};
        for (int k = 0; k < 4; ++k)
          u[4 * h + k] = _mm256_add_epi8(_mm256_or_si256(u[4 * h + k], _mm256_and_si256(t[k], top)), k96);
      }
    }
  } else {
    for (int c = 0; c < 8; ++c) u[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * c));
  }
}

// AVX2 has no u8 x s8 dot product into int32: maddubs (pairs into int16) then madd (pairs into int32). int4:
// 8 maddubs results add in int16 without overflow (8 * 2 * 15 * 127 < 2^15); int8: the sign of the weight moves
// onto the activation (|w| * sign(a, w)) and each chunk widens to int32 at once.
__attribute__((target("avx2,fma,f16c")))
inline __m256i block_dot_avx2(const __m256i* u, const int8_t* qa, bool int4, int32_t sq) {
  const int32_t* q4 = reinterpret_cast<const int32_t*>(qa);
  const __m256i ones = _mm256_set1_epi16(1);
  if (int4) {
    __m256i s16 = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(q4[0]));
    for (int c = 1; c < 8; ++c) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[c], _mm256_set1_epi32(q4[c])));
    return _mm256_madd_epi16(s16, ones);
  }
  const __m256i k128 = _mm256_set1_epi8(char(0x80));
  __m256i p = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    const __m256i wq = _mm256_xor_si256(u[c], k128);                      // back to the signed weights
    const __m256i a = _mm256_sign_epi8(_mm256_set1_epi32(q4[c]), wq);
    p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wq), a), ones));
  }
  return p;
}

// int6 on AVX2 (u: the integers + 128): the sign moves onto the activation as for int8; |w| <= 32, so a half's 4 maddubs results add in
// int16 without overflow (4 * 2 * 32 * 127 < 2^15) before one madd widens them.
__attribute__((target("avx2,fma,f16c")))
inline void block_dot2_avx2(const __m256i* u, const int8_t* qa, int32_t, int32_t, __m256i& lo, __m256i& hi) {
  const int32_t* q4 = reinterpret_cast<const int32_t*>(qa);
  const __m256i ones = _mm256_set1_epi16(1), k128 = _mm256_set1_epi8(char(0x80));
  __m256i s[2];
  for (int h = 0; h < 2; ++h) {
    s[h] = _mm256_setzero_si256();
    for (int c = 4 * h; c < 4 * h + 4; ++c) {
      const __m256i wq = _mm256_xor_si256(u[c], k128);
      const __m256i a = _mm256_sign_epi8(_mm256_set1_epi32(q4[c]), wq);
      s[h] = _mm256_add_epi16(s[h], _mm256_maddubs_epi16(_mm256_abs_epi8(wq), a));
    }
  }
  lo = _mm256_madd_epi16(s[0], ones);
  hi = _mm256_madd_epi16(s[1], ones);
}

// A block's weights and scales PREFETCH_BYTES ahead of the one being read. A forward streams every weight once,
// and one core's demand misses alone keep too few lines in flight to reach the memory's bandwidth (SmolLM2
// Q4_1, one token, 2 threads: 5.6 ms a forward without, 4.0 ms with, on a Xeon whose caches do not hold the
// 112 MB). A prefetch past the end of the weights is harmless: it never faults.
constexpr int64_t PREFETCH_BYTES = 4096;

__attribute__((target("avx2,f16c"))) LEAPLM_INLINE void prefetch_ahead(const W& w, int64_t q_at, int64_t s_at) {
  const char* q = reinterpret_cast<const char*>(w.q + q_at) + PREFETCH_BYTES;
  for (int64_t b = 0; b < w.block_bytes(); b += 64) _mm_prefetch(q + b, _MM_HINT_T0);
  // scales and minimums: 16 or 32 bytes per block against the integers' 128 or 256, so a fraction of the distance
  const int64_t sb = w.scale_bytes(), ahead = PREFETCH_BYTES * sb * RG / w.block_bytes();
  _mm_prefetch(static_cast<const char*>(w.s) + s_at * sb + ahead, _MM_HINT_T0);
  if (w.m) _mm_prefetch(static_cast<const char*>(w.m) + s_at * sb + ahead, _MM_HINT_T0);
}

// 8 scales or minimums of `base` (w.s or w.m; sup: w.ss or w.ms) from index i (a multiple of 8), as fp32
__attribute__((target("avx2,f16c"))) LEAPLM_INLINE __m256 load8(const W& w, const void* base, const uint16_t* sup,
                                                               int64_t i) {
  if (sup) {                      // int8 multiples of the fp16 super-block scales: both widened, the product exact
    const __m128i k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + w.super_of(i))));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k)), d);
  }
  if (w.s16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(base) + i);
}

__attribute__((target("avx2,f16c"))) LEAPLM_INLINE __m256 load_scale8(const W& w, int64_t i) {
  return load8(w, w.s, w.ss, i);
}

// 8 minimums of an int4 weight from index i, as fp32: stored, or mk times the scales (min_at)
__attribute__((target("avx2,f16c"))) LEAPLM_INLINE __m256 load_min8(const W& w, int64_t i) {
  return w.m ? load8(w, w.m, w.ms, i) : _mm256_mul_ps(_mm256_set1_ps(w.mk), load_scale8(w, i));
}

#define LEAPLM_GROUP_BODY_HALF(DOT2)                                                                            \
  const int G = w.G;                                                                                            \
  const int64_t K = act.K;                                                                                      \
  __m256 acc[TT];                                                                                               \
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_load_ps(accp + 8 * t);                                           \
  for (int g = ga; g < gb; ++g) {                                                                               \
    __m256i u[8];                                                                                               \
    prefetch_ahead(w, (grp * G + g) * w.block_bytes(), (grp * G + g) * 2 * RG);                                \
    load_block(w, w.q + (grp * G + g) * w.block_bytes(), u);          /* int6: already q + 128 */               \
    const __m256 slo = load_scale8(w, (grp * G + g) * 2 * RG), shi = load_scale8(w, (grp * G + g) * 2 * RG + RG);  \
    for (int t = 0; t < TT; ++t) {                                                                              \
      const int tg = (t0 + t) * G + g;                                                                          \
      __m256i lo, hi;                                                                                           \
      DOT2(u, act.qa.data() + (t0 + t) * K + g * QK, act.sq[tg], act.sq16[tg], lo, hi);                         \
      const __m256 av = _mm256_set1_ps(act.a[tg]);                                                              \
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(slo, av), acc[t]);                         \
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(shi, av), acc[t]);                         \
    }                                                                                                           \
  }                                                                                                             \
  for (int t = 0; t < TT; ++t) _mm256_store_ps(accp + 8 * t, acc[t]);

#define LEAPLM_GROUP_BODY(DOT)                                                                                  \
  const int G = w.G;                                                                                            \
  const int64_t K = act.K;                                                                                      \
  __m256 acc[TT];                                                                                               \
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_load_ps(accp + 8 * t);                                           \
  const __m256i k128 = _mm256_set1_epi8(char(0x80));                                                            \
  for (int g = ga; g < gb; ++g) {                                                                               \
    __m256i u[8];                                                                                               \
    prefetch_ahead(w, (grp * G + g) * w.block_bytes(), (grp * G + g) * RG);                                    \
    load_block(w, w.q + (grp * G + g) * w.block_bytes(), u);                                                    \
    if (!w.int4)                                                                                                \
      for (int c = 0; c < 8; ++c) u[c] = _mm256_xor_si256(u[c], k128);                                         \
    const __m256 sv = load_scale8(w, (grp * G + g) * RG);                                                       \
    for (int t = 0; t < TT; ++t) {                                                                              \
      const int tg = (t0 + t) * G + g;                                                                          \
      const __m256i p = DOT(u, act.qa.data() + (t0 + t) * K + g * QK, w.int4, act.sq[tg]);                      \
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sv, _mm256_set1_ps(act.a[tg])), acc[t]);    \
    }                                                                                                           \
  }                                                                                                             \
  for (int t = 0; t < TT; ++t) _mm256_store_ps(accp + 8 * t, acc[t]);

// y[t, 8 grp + r] = acc[t][r] + mt[t][r] for tokens t0 .. t0 + TN - 1: the min term's chains run here, after the
// dot products, TN tokens' chains side by side (each is a chain of dependent FMAs: one at a time would wait on the
// FMA latency at every block)
template <int TN>
__attribute__((target("avx2,fma,f16c")))
void store_tokens(const W& w, const Act& act, int64_t grp, int t0, const float* accs, float* y) {
  const int G = w.G;
  __m256 mt[TN];
  for (int t = 0; t < TN; ++t) mt[t] = _mm256_setzero_ps();
  if (w.int4)
    for (int g = 0; g < G; ++g) {
      const __m256 mv = load_min8(w, (grp * G + g) * RG);
      for (int t = 0; t < TN; ++t) mt[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(act.sa[(t0 + t) * G + g]), mt[t]);
    }
  const int64_t n0 = grp * RG;
  const int rows = int(std::min<int64_t>(RG, w.N - n0));
  for (int t = 0; t < TN; ++t) {
    alignas(32) float out[8];
    _mm256_store_ps(out, _mm256_add_ps(_mm256_load_ps(accs + 8 * (t0 + t)), mt[t]));
    std::memcpy(y + (t0 + t) * w.ldy + n0, out, sizeof(float) * rows);
  }
}

template <int TN>
inline void store_tail(int rem, const W& w, const Act& act, int64_t grp, int t0, const float* accs, float* y) {
  if constexpr (TN >= 1) {
    if (rem == TN) store_tokens<TN>(w, act, grp, t0, accs, y);
    else store_tail<TN - 1>(rem, w, act, grp, t0, accs, y);
  }
}

// y[t, 8 grp + r] = acc[t][r] + mt[t][r] for every token
void store_group(const W& w, const Act& act, int64_t grp, const float* accs, float* y) {
  int t = 0;
  for (; t + 8 <= act.T; t += 8) store_tokens<8>(w, act, grp, t, accs, y);
  if (t < act.T) store_tail<7>(act.T - t, w, act, grp, t, accs, y);
}

// Tokens t0 .. t0 + TT - 1 of one row group over blocks ga .. gb - 1, continuing the fp32 sums in accp [TT, 8].
template <int TT>
__attribute__((target("avx2,fma,f16c")))
void group_avx2(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  LEAPLM_GROUP_BODY(block_dot_avx2)
}

template <int TT>
__attribute__((target("avx2,fma,f16c")))
void group_avx2_half(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  LEAPLM_GROUP_BODY_HALF(block_dot2_avx2)
}

}  // namespace
#endif

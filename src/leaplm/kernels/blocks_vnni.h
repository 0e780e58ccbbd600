// Block products with AVX-512 VNNI's u8 x s8 dot product (vpdpbusd):
//   one row group   8 lanes, as blocks_avx2.h (group_vnni, group_vnni_half), for T < PAIR_MIN_T
//   pairs of groups 16 lanes (pair_vnni): lane r of the low half is row 8 grp + r, of the high half row
//                   8 (grp + 1) + r; block g of grp + 1 sits G * block bytes after grp's; scales 16 from load_scale16;
//                   tokens read block-major (activations.h: qab [G, T, 32], ab, sqb [G, T]), TT <= PAIR_TMAX a tile
// The arithmetic per (row, token) is the scalar reference's, so the bits are the same.
#pragma once

#include "activations.h"
#include "blocks_avx2.h"
#include "common.h"

#if defined(__x86_64__)
namespace {

// P[r] = sum_c sum_i u[c][r, i] * qa[4c + i] for the 8 rows (exact int32).
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
inline __m256i block_dot_vnni(const __m256i* u, const int8_t* qa, bool int4, int32_t sq) {
  const int32_t* q4 = reinterpret_cast<const int32_t*>(qa);
  __m256i p = _mm256_setzero_si256();
  __m256i p2 = _mm256_setzero_si256();
  for (int c = 0; c < 8; c += 2) {
    p = _mm256_dpbusd_epi32(p, u[c], _mm256_set1_epi32(q4[c]));
    p2 = _mm256_dpbusd_epi32(p2, u[c + 1], _mm256_set1_epi32(q4[c + 1]));
  }
  p = _mm256_add_epi32(p, p2);
  if (!int4) p = _mm256_sub_epi32(p, _mm256_set1_epi32(128 * sq));   // the +128 of the unsigned weights
  return p;
}

// int6: the two halves' products (chunks 0 .. 3 hold elements 0 .. 15, chunks 4 .. 7 elements 16 .. 31), exact
// int32; u the integers + 128 (load_block), each half corrected by 128 * its sum of qa.
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
inline void block_dot2_vnni(const __m256i* u, const int8_t* qa, int32_t sq, int32_t sq16, __m256i& lo, __m256i& hi) {
  const int32_t* q4 = reinterpret_cast<const int32_t*>(qa);
  __m256i a = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u[0], _mm256_set1_epi32(q4[0]));
  __m256i b = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u[4], _mm256_set1_epi32(q4[4]));
  for (int c = 1; c < 4; ++c) {
    a = _mm256_dpbusd_epi32(a, u[c], _mm256_set1_epi32(q4[c]));
    b = _mm256_dpbusd_epi32(b, u[c + 4], _mm256_set1_epi32(q4[c + 4]));
  }
  lo = _mm256_sub_epi32(a, _mm256_set1_epi32(128 * sq16));
  hi = _mm256_sub_epi32(b, _mm256_set1_epi32(128 * (sq - sq16)));
}

// the 16 scales of row groups grp and grp + 1 (their block g at i and i + next)
__attribute__((target("avx2,f16c,avx512f,avx512dq"))) LEAPLM_INLINE __m512 load_scale16(const W& w, int64_t i,
                                                                                        int64_t next) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(load_scale8(w, i)), load_scale8(w, i + next), 1);
}

// and their 16 minimums (int4)
__attribute__((target("avx2,f16c,avx512f,avx512dq"))) LEAPLM_INLINE __m512 load_min16(const W& w, int64_t i,
                                                                                      int64_t next) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(load_min8(w, i)), load_min8(w, i + next), 1);
}

// store_tokens for row groups grp and grp + 1 at once (16 lanes: each lane's min-term chain and final add are the
// 8-lane form's, so the same bits), from their sums lo, hi [T, 8]
template <int TN>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,f16c")))
void store_pair_tokens(const W& w, const Act& act, int64_t grp, int t0, const float* lo, const float* hi, float* y) {
  const int G = w.G;
  __m512 mt[TN];
  for (int t = 0; t < TN; ++t) mt[t] = _mm512_setzero_ps();
  if (w.int4) {
    for (int g = 0; g < G; ++g) {
      const __m512 mv = load_min16(w, (grp * G + g) * RG, int64_t(G) * RG);
      for (int t = 0; t < TN; ++t) mt[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(act.sa[(t0 + t) * G + g]), mt[t]);
    }
  }
  const int64_t n0 = grp * RG;
  const int rows = int(std::min<int64_t>(2 * RG, w.N - n0));
  for (int t = 0; t < TN; ++t) {
    const __m512 acc = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(lo + 8 * (t0 + t))),
                                          _mm256_load_ps(hi + 8 * (t0 + t)), 1);
    alignas(64) float out[16];
    _mm512_store_ps(out, _mm512_add_ps(acc, mt[t]));
    std::memcpy(y + (t0 + t) * w.ldy + n0, out, sizeof(float) * rows);
  }
}

template <int TN>
inline void store_pair_tail(int rem, const W& w, const Act& act, int64_t grp, int t0, const float* lo,
                            const float* hi, float* y) {
  if constexpr (TN >= 1) {
    if (rem == TN) store_pair_tokens<TN>(w, act, grp, t0, lo, hi, y);
    else store_pair_tail<TN - 1>(rem, w, act, grp, t0, lo, hi, y);
  }
}

// y for every token of row groups grp and grp + 1
void store_pair(const W& w, const Act& act, int64_t grp, const float* lo, const float* hi, float* y) {
  for (int t = 0; t < act.T; t += 16) store_pair_tail<16>(std::min(16, act.T - t), w, act, grp, t, lo, hi, y);
}

template <int TT>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
void group_vnni(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  LEAPLM_GROUP_BODY(block_dot_vnni)
}

template <int TT>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
void group_vnni_half(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  LEAPLM_GROUP_BODY_HALF(block_dot2_vnni)
}

// acc += the u8 x s8 dot products of w's 16 lanes with the int8 quadruple at p broadcast to every lane: the
// broadcast is the instruction's own memory operand ({1to16}), not a separate instruction.
__attribute__((target("avx512f,avx512vnni")))
LEAPLM_INLINE __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %[m]%{1to16%}, %[w], %[acc]"
      : [acc] "+v"(acc)
      : [w] "v"(w), [m] "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Block g of row groups grp (at lo) and grp + 1 (at hi) as 8 vectors, vector c holding elements 4c .. 4c+3 of
// grp's 8 rows in its low half and of grp + 1's in its high half: int4, the nibbles as bytes 0..15 (low nibbles in
// u[0..3], high ones in u[4..7]); int8, the signed bytes as stored
__attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512vl,f16c")))
LEAPLM_INLINE __m512i both_halves(const uint8_t* lo, const uint8_t* hi, int off) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + off))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + off)), 1);
}

template <bool INT4>
__attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512vl,f16c")))
LEAPLM_INLINE void load_pair(const uint8_t* lo, const uint8_t* hi, __m512i* u) {
  if constexpr (INT4) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = both_halves(lo, hi, 32 * c);
      u[c] = _mm512_and_si512(v, nib);
      u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
  } else {
    for (int c = 0; c < 8; ++c) u[c] = both_halves(lo, hi, 32 * c);
  }
}

// Two row groups (16 rows) in 512-bit vectors: lane r of the low half is row 8 grp + r, of the high half row
// 8 (grp + 1) + r. Each activation broadcast feeds 16 rows' dot products and each unpacked weight vector all TT
// tokens; the arithmetic per (row, token) is the single group's (exact int32 block products, then
// fma(float(P), s * a, acc) block by block), so the bits are the same.
template <int TT, bool INT4>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")))
void pair_vnni(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* acc_lo, float* acc_hi) {
  const int G = w.G, T = act.T;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t)
    acc[t] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(acc_lo + 8 * t)),
                                _mm256_load_ps(acc_hi + 8 * t), 1);
  const int64_t bb = w.block_bytes();
  for (int g = ga; g < gb; ++g) {
    const uint8_t* lo = w.q + (grp * G + g) * bb;
    const uint8_t* hi = lo + int64_t(G) * bb;                 // the same block of the next row group
    prefetch_ahead(w, (grp * G + g) * bb, (grp * G + g) * RG);
    prefetch_ahead(w, ((grp + 1) * G + g) * bb, ((grp + 1) * G + g) * RG);
    __m512i u[8];
    load_pair<INT4>(lo, hi, u);
    if constexpr (!INT4) {
      const __m512i k128 = _mm512_set1_epi8(char(0x80));
      for (int c = 0; c < 8; ++c) u[c] = _mm512_xor_si512(u[c], k128);
    }
    const __m512 sv = load_scale16(w, (grp * G + g) * RG, int64_t(G) * RG);
    const int8_t* qb = act.qab.data() + (int64_t(g) * T + t0) * QK;   // token t's block at qb + 32 t
    const float* ag = act.ab.data() + int64_t(g) * T + t0;
    const int32_t* sg = act.sqb.data() + int64_t(g) * T + t0;
    for (int t = 0; t < TT; ++t) {
      const int8_t* q = qb + QK * t;
      __m512i p = _mm512_setzero_si512(), p2 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        p = dpbusd_bcast(p, u[c], q + 4 * c);
        p2 = dpbusd_bcast(p2, u[c + 1], q + 4 * c + 4);
      }
      p = _mm512_add_epi32(p, p2);
      if constexpr (!INT4) p = _mm512_sub_epi32(p, _mm512_set1_epi32(128 * sg[t]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sv, _mm512_set1_ps(ag[t])), acc[t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    _mm256_store_ps(acc_lo + 8 * t, _mm512_castps512_ps256(acc[t]));
    _mm256_store_ps(acc_hi + 8 * t, _mm512_extractf32x8_ps(acc[t], 1));
  }
}

// int6 blocks of row groups grp (at lo) and grp + 1 (at hi) as 8 vectors of the integers + 128, as load_block
// unpacks one group's (the low nibbles' chunks, then the top 2 bits moved to bits 4, 5; u6 + 96 = q + 128)
__attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512vl,f16c")))
LEAPLM_INLINE void load_pair6(const uint8_t* lo, const uint8_t* hi, __m512i* u) {
  const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30), k96 = _mm512_set1_epi8(96);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = both_halves(lo, hi, 32 * c);
    u[c] = _mm512_and_si512(v, nib);
    u[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  }
  for (int h = 0; h < 2; ++h) {
    const __m512i v = both_halves(lo, hi, 128 + 32 * h);
    const __m512i t[4] = {_mm512_slli_epi16(v, 4), _mm512_slli_epi16(v, 2), v, _mm512_srli_epi16(v, 2)};
    for (int k = 0; k < 4; ++k)
      u[4 * h + k] = _mm512_add_epi8(_mm512_or_si512(u[4 * h + k], _mm512_and_si512(t[k], top)), k96);
  }
}

// pair_vnni for int6: each half block's product (chunks 0 .. 3, then 4 .. 7) corrected by 128 times its own sum of
// qa and added with its own scale, the low half first, as group_vnni_half does one group's: the same bits.
template <int TT>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")))
void pair_vnni_half(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* acc_lo, float* acc_hi) {
  const int G = w.G, T = act.T;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t)
    acc[t] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(acc_lo + 8 * t)),
                                _mm256_load_ps(acc_hi + 8 * t), 1);
  const int64_t bb = w.block_bytes(), sn = int64_t(G) * 2 * RG;     // the next group's block and scales
  for (int g = ga; g < gb; ++g) {
    const uint8_t* lo = w.q + (grp * G + g) * bb;
    const uint8_t* hi = lo + int64_t(G) * bb;
    const int64_t si = (grp * G + g) * 2 * RG;
    prefetch_ahead(w, (grp * G + g) * bb, si);
    prefetch_ahead(w, ((grp + 1) * G + g) * bb, si + sn);
    __m512i u[8];
    load_pair6(lo, hi, u);
    const __m512 slo = load_scale16(w, si, sn), shi = load_scale16(w, si + RG, sn);
    const int8_t* qb = act.qab.data() + (int64_t(g) * T + t0) * QK;   // token t's block at qb + 32 t
    const float* ag = act.ab.data() + int64_t(g) * T + t0;
    const int32_t* sg = act.sqb.data() + int64_t(g) * T + t0;
    const int32_t* s16 = act.sqb16.data() + int64_t(g) * T + t0;
    for (int t = 0; t < TT; ++t) {
      const int8_t* q = qb + QK * t;
      __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        a = dpbusd_bcast(a, u[c], q + 4 * c);
        b = dpbusd_bcast(b, u[c + 4], q + 16 + 4 * c);
      }
      a = _mm512_sub_epi32(a, _mm512_set1_epi32(128 * s16[t]));
      b = _mm512_sub_epi32(b, _mm512_set1_epi32(128 * (sg[t] - s16[t])));
      const __m512 av = _mm512_set1_ps(ag[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(slo, av), acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_mul_ps(shi, av), acc[t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    _mm256_store_ps(acc_lo + 8 * t, _mm512_castps512_ps256(acc[t]));
    _mm256_store_ps(acc_hi + 8 * t, _mm512_extractf32x8_ps(acc[t], 1));
  }
}

template <int TT>
inline void pair_tile(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* lo, float* hi) {
  if (w.half) pair_vnni_half<TT>(w, act, grp, t0, ga, gb, lo, hi);
  else if (w.int4) pair_vnni<TT, true>(w, act, grp, t0, ga, gb, lo, hi);
  else pair_vnni<TT, false>(w, act, grp, t0, ga, gb, lo, hi);
}

template <int TT>
inline void pair_tail(int rem, const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* lo, float* hi) {
  if constexpr (TT >= 1) {
    if (rem == TT) pair_tile<TT>(w, act, grp, t0, ga, gb, lo, hi);
    else pair_tail<TT - 1>(rem, w, act, grp, t0, ga, gb, lo, hi);
  }
}

// Row groups grp and grp + 1 (every format) as group_simd<true> computes each.
void pair_simd(const W& w, const Act& act, int64_t grp, float* y) {
  constexpr int TMAX = PAIR_TMAX;
  alignas(32) float lo[MAX_T * 8], hi[MAX_T * 8];
  std::memset(lo, 0, sizeof(float) * 8 * act.T);
  std::memset(hi, 0, sizeof(float) * 8 * act.T);
  const int G = w.G;
  const int chunk = act.T <= TMAX ? G : std::max(1, ACT_L1_BYTES / (QK * act.T));
  for (int ga = 0; ga < G; ga += chunk) {
    const int gb = std::min(G, ga + chunk);
    int t = 0;
    for (; t + TMAX <= act.T; t += TMAX) pair_tile<TMAX>(w, act, grp, t, ga, gb, lo + 8 * t, hi + 8 * t);
    if (t < act.T) pair_tail<TMAX - 1>(act.T - t, w, act, grp, t, ga, gb, lo + 8 * t, hi + 8 * t);
  }
  store_pair(w, act, grp, lo, hi, y);
}

}  // namespace
#endif

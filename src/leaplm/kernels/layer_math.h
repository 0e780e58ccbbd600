// The layer loop's element-wise and reduction arithmetic, all fp32, rows contiguous: RMS norms over a row of n,
// the gated MLP activation over gu [M, 2 inter] (gate | up), exp, and attention of one query over its allowed key
// slots of a KV cache head [capacity, D]. Each exists as a baseline reference and an AVX2 form with the same
// operations per element in the same order (no FMA contraction): the same bits.
#pragma once

#include "common.h"
#include "pool.h"

namespace {

// e^v for v in [-87, 88]: 2^round(v log2 e) times a degree-6 polynomial (relative error ~3e-7). exp_base is the
// reference; exp_avx2 computes 8 lanes at a time with the same operations per element (the clamps pick the
// constant for NaN as std::max/min do; multiplies and adds are separate, never fused), so the same bits.
LEAPLM_INLINE float exp1(float x) {
  const float v = std::min(88.f, std::max(-87.f, x));
  float r = v * 1.44269504088896341f + 12582912.f;         // round to nearest by the fp32 magic number
  r -= 12582912.f;
  const float f = (v - r * 0.693145751953125f) - r * 1.428606765330187e-06f;
  const float p = 1.f + f * (1.f + f * (0.5f + f * (0.166666672f + f * (0.0416666679f + f * (0.00833333377f +
                                                                                        f * 0.00138888892f)))));
  const int32_t bits = (int32_t(r) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

void exp_base(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = exp1(x[i]);
}

LEAPLM_INLINE float lane_sum(const float* v) {   // fixed tree over 8 lanes: ((0+4)+(2+6)) + ((1+5)+(3+7))
  const float s04 = v[0] + v[4], s15 = v[1] + v[5], s26 = v[2] + v[6], s37 = v[3] + v[7];
  return (s04 + s26) + (s15 + s37);
}

LEAPLM_INLINE float dot8(const float* a, const float* b, int64_t n) {   // n a multiple of 8; 8 lanes, fixed tree
  float acc[8] = {};
  for (int64_t i = 0; i < n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  return lane_sum(acc);
}

#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) LEAPLM_INLINE __m256 exp8(__m256 x) {
  const __m256 magic = _mm256_set1_ps(12582912.f);
  const __m256 v = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  __m256 r = _mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)), magic);
  r = _mm256_sub_ps(r, magic);
  const __m256 f = _mm256_sub_ps(_mm256_sub_ps(v, _mm256_mul_ps(r, _mm256_set1_ps(0.693145751953125f))),
                                 _mm256_mul_ps(r, _mm256_set1_ps(1.428606765330187e-06f)));
  __m256 p = _mm256_add_ps(_mm256_set1_ps(0.00833333377f), _mm256_mul_ps(f, _mm256_set1_ps(0.00138888892f)));
  p = _mm256_add_ps(_mm256_set1_ps(0.0416666679f), _mm256_mul_ps(f, p));
  p = _mm256_add_ps(_mm256_set1_ps(0.166666672f), _mm256_mul_ps(f, p));
  p = _mm256_add_ps(_mm256_set1_ps(0.5f), _mm256_mul_ps(f, p));
  p = _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_mul_ps(f, p));
  p = _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_mul_ps(f, p));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(r), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,f16c"))) void exp_avx2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) x[i] = exp1(x[i]);
}

// dot8's lane_sum of the 8 lanes of v, by the same tree
__attribute__((target("avx2,f16c"))) LEAPLM_INLINE float lane_sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));   // 0+4, 1+5, 2+6, 3+7
  const __m128 u = _mm_add_ps(s, _mm_movehl_ps(s, s));                                   // (0+4)+(2+6), (1+5)+(3+7)
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}
#endif

// y = x + d, then rms_norm(y) per row (rows m0 .. m1 - 1): the residual add and the next layer's norm in one pass
LEAPLM_INLINE void add_norm_body(float* x, const float* d, const float* w, int64_t m0, int64_t m1, int64_t n,
                                 float eps, float* y) {
  for (int64_t m = m0; m < m1; ++m) {
    float* xm = x + m * n;
    if (d)
      for (int64_t i = 0; i < n; ++i) xm[i] += d[m * n + i];
    const float r = 1.f / std::sqrt(dot8(xm, xm, n) / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) y[m * n + i] = (xm[i] * r) * w[i];
  }
}

// The gated MLP's activation: out = act(gate) * up per row, gate = gu[:, :inter], up = gu[:, inter:], with
//   silu(g)      = g / (1 + e^-g)
//   gelu_tanh(g) = g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3)   (= 0.5 g (1 + tanh u), PyTorch's
//                  gelu(approximate="tanh"), written through the kernel's own exp so both builds give the same bits)
// exp_ is exp_base or exp_avx2 (the same bits).
enum MlpAct : int { SILU = 0, GELU_TANH = 1 };

template <int A>
LEAPLM_INLINE void glu_body(const float* gu, int64_t m0, int64_t m1, int64_t inter, float* out,
                            void (*exp_)(float*, int64_t)) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* g = gu + m * 2 * inter;
    float* o = out + m * inter;
    if constexpr (A == GELU_TANH)
      for (int64_t i = 0; i < inter; ++i) o[i] = (g[i] + 0.044715f * (g[i] * g[i] * g[i])) * -1.59576912f;
    else
      for (int64_t i = 0; i < inter; ++i) o[i] = -g[i];
    exp_(o, inter);
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + o[i]) * g[inter + i];
  }
}

void add_norm_base(float* x, const float* d, const float* w, int64_t m0, int64_t m1, int64_t n, float eps, float* y) {
  add_norm_body(x, d, w, m0, m1, n, eps, y);
}
void glu_base(int act, const float* gu, int64_t m0, int64_t m1, int64_t inter, float* out) {
  if (act == GELU_TANH) glu_body<GELU_TANH>(gu, m0, m1, inter, out, exp_base);
  else glu_body<SILU>(gu, m0, m1, inter, out, exp_base);
}
#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) void add_norm_avx2(float* x, const float* d, const float* w, int64_t m0, int64_t m1,
                                                   int64_t n, float eps, float* y) {
  add_norm_body(x, d, w, m0, m1, n, eps, y);
}
__attribute__((target("avx2,f16c"))) void glu_avx2(int act, const float* gu, int64_t m0, int64_t m1, int64_t inter,
                                              float* out) {
  if (act == GELU_TANH) glu_body<GELU_TANH>(gu, m0, m1, inter, out, exp_avx2);
  else glu_body<SILU>(gu, m0, m1, inter, out, exp_avx2);
}
#else
void add_norm_avx2(float* x, const float* d, const float* w, int64_t m0, int64_t m1, int64_t n, float eps, float* y) {
  add_norm_body(x, d, w, m0, m1, n, eps, y);
}
void glu_avx2(int act, const float* gu, int64_t m0, int64_t m1, int64_t inter, float* out) {
  glu_base(act, gu, m0, m1, inter, out);
}
#endif

// fn(m0, m1) over rows 0 .. M - 1, split across the threads when there are enough rows to pay for waking them
// (each row is computed alone, so the split never changes a bit)
template <typename F>
void over_rows(int64_t M, int64_t min_rows, const F& fn) {
  if (M < min_rows) return fn(0, M);
  leaplm_pool::parallel_for(M, 1, fn);
}

// softmax(q k^T * scale) v for one query over its n allowed keys (key slots `keys`, in key order); p [n] scratch.
// The arithmetic, which attend_avx2 computes with the same operations in 8-lane vectors:
//   p[k]  = dot8(q, key k) * scale;  mx = the max of p, in key order;  p[k] = exp(p[k] - mx)
//   sum   = lane_sum of 8 lanes, lane l summing p[k] for k = l, l + 8, ... in order
//   dst   = o * (1 / sum),  o[d] = sum over k in key order of p[k] * v[k][d], from 0
void attend_base(const float* q, const float* kb, const float* vb, const int64_t* keys, int64_t n, int64_t D,
                 float scale, float* p, float* dst) {
  for (int64_t k = 0; k < n; ++k) p[k] = dot8(q, kb + keys[k] * D, D) * scale;
  float mx = -INFINITY;
  for (int64_t k = 0; k < n; ++k) mx = std::max(mx, p[k]);
  for (int64_t k = 0; k < n; ++k) p[k] = exp1(p[k] - mx);
  float lanes[8] = {};
  for (int64_t k = 0; k < n; ++k) lanes[k % 8] += p[k];
  const float sum = lane_sum(lanes);
  const float inv = n ? 1.f / sum : 0.f;
  for (int64_t d = 0; d < D; ++d) {
    float o = 0.f;
    for (int64_t k = 0; k < n; ++k) o += p[k] * vb[keys[k] * D + d];
    dst[d] = o * inv;
  }
}

#if defined(__x86_64__)
// attend_base's arithmetic in 8-lane vectors: the scores 4 keys at a time (independent chains), the weighted
// values 32 dimensions at a time over all keys (4 independent chains per key), o kept in registers.
__attribute__((target("avx2,f16c"))) void attend_avx2(const float* q, const float* kb, const float* vb, const int64_t* keys,
                                                 int64_t n, int64_t D, float scale, float* p, float* dst) {
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const float* k0 = kb + keys[k] * D;
    const float* k1 = kb + keys[k + 1] * D;
    const float* k2 = kb + keys[k + 2] * D;
    const float* k3 = kb + keys[k + 3] * D;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(qv, _mm256_loadu_ps(k0 + i)));
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(qv, _mm256_loadu_ps(k1 + i)));
      a2 = _mm256_add_ps(a2, _mm256_mul_ps(qv, _mm256_loadu_ps(k2 + i)));
      a3 = _mm256_add_ps(a3, _mm256_mul_ps(qv, _mm256_loadu_ps(k3 + i)));
    }
    p[k] = lane_sum8(a0) * scale, p[k + 1] = lane_sum8(a1) * scale;
    p[k + 2] = lane_sum8(a2) * scale, p[k + 3] = lane_sum8(a3) * scale;
  }
  for (; k < n; ++k) {
    const float* kk = kb + keys[k] * D;
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kk + i)));
    p[k] = lane_sum8(a) * scale;
  }
  float mx = -INFINITY;
  for (k = 0; k < n; ++k) mx = std::max(mx, p[k]);
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 lanes = _mm256_setzero_ps();
  for (k = 0; k + 8 <= n; k += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + k), mv));
    _mm256_storeu_ps(p + k, e);
    lanes = _mm256_add_ps(lanes, e);
  }
  alignas(32) float l8[8];
  _mm256_store_ps(l8, lanes);
  for (; k < n; ++k) {
    p[k] = exp1(p[k] - mx);
    l8[k % 8] += p[k];
  }
  const float sum = lane_sum(l8);
  const __m256 inv = _mm256_set1_ps(n ? 1.f / sum : 0.f);
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 o0 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps(), o2 = _mm256_setzero_ps(), o3 = _mm256_setzero_ps();
    for (k = 0; k < n; ++k) {
      const float* v = vb + keys[k] * D + d;
      const __m256 pk = _mm256_set1_ps(p[k]);
      o0 = _mm256_add_ps(o0, _mm256_mul_ps(pk, _mm256_loadu_ps(v)));
      o1 = _mm256_add_ps(o1, _mm256_mul_ps(pk, _mm256_loadu_ps(v + 8)));
      o2 = _mm256_add_ps(o2, _mm256_mul_ps(pk, _mm256_loadu_ps(v + 16)));
      o3 = _mm256_add_ps(o3, _mm256_mul_ps(pk, _mm256_loadu_ps(v + 24)));
    }
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(o0, inv));
    _mm256_storeu_ps(dst + d + 8, _mm256_mul_ps(o1, inv));
    _mm256_storeu_ps(dst + d + 16, _mm256_mul_ps(o2, inv));
    _mm256_storeu_ps(dst + d + 24, _mm256_mul_ps(o3, inv));
  }
  for (; d < D; d += 8) {
    __m256 o = _mm256_setzero_ps();
    for (k = 0; k < n; ++k) o = _mm256_add_ps(o, _mm256_mul_ps(_mm256_set1_ps(p[k]), _mm256_loadu_ps(vb + keys[k] * D + d)));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(o, inv));
  }
}
#else
void attend_avx2(const float* q, const float* kb, const float* vb, const int64_t* keys, int64_t n, int64_t D,
                 float scale, float* p, float* dst) {
  attend_base(q, kb, vb, keys, n, D, scale, p, dst);
}
#endif


}  // namespace

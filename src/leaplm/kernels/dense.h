// fp32 linears for small dense models (a draft's whole forward in one call): x [M, K] fp32, w [N, K] row-major fp32
// or bf16 (widened exactly), y [M, N]; split across threads in chunks of DENSE_CHUNK weight rows.
#pragma once

#include <ATen/Parallel.h>

#include "common.h"
#include "layer_math.h"
#include "pool.h"

namespace {

// ---- fp32 linears (small dense models: a draft's whole forward in one call) --------------------------------------
// y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for w [N, K] row-major, K a multiple of 8, its elements fp32 or bf16 (a
// weight that bf16 holds exactly, as a checkpoint stored in bf16 is: half the bytes to read, the same numbers; each
// is widened to fp32, exactly, before it is used). Each dot is dot8's: lane l sums k = l, l + 8, ... in order, then
// lane_sum's fixed tree, so a token's result does not depend on M, on the rows' split across threads, on the
// instruction set (no fused multiply-add on any path) or on the weight's storage.
LEAPLM_INLINE float widen(float v) { return v; }
LEAPLM_INLINE float widen(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename WT>
LEAPLM_INLINE void dense_rows_body(const float* x, int64_t M, int64_t K, const WT* w, const float* b, int64_t n0,
                                   int64_t n1, int64_t N, float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const WT* wn = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float acc[8] = {};
      for (int64_t i = 0; i < K; i += 8)
        for (int l = 0; l < 8; ++l) acc[l] += xm[i + l] * widen(wn[i + l]);
      y[m * N + n] = lane_sum(acc) + (b ? b[n] : 0.f);
    }
  }
}

template <typename WT>
void dense_rows_base(const float* x, int64_t M, int64_t K, const WT* w, const float* b, int64_t n0, int64_t n1,
                     int64_t N, float* y) {
  dense_rows_body(x, M, K, w, b, n0, n1, N, y);
}

#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) LEAPLM_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,f16c"))) LEAPLM_INLINE __m256 load8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// the same sums as dense_rows_body, lane l of a 256-bit vector holding lane l's accumulator (multiply, then add:
// the scalar path's bits), eight weight rows at a time, each read once for all M tokens from L1
template <typename WT>
__attribute__((target("avx2,f16c"))) void dense_rows_avx2(const float* x, int64_t M, int64_t K, const WT* w,
                                                     const float* b, int64_t n0, int64_t n1, int64_t N, float* y) {
  int64_t n = n0;
  alignas(32) float lanes[8];
  for (; n + 8 <= n1; n += 8) {
    const WT* wn = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      __m256 a[8];
      for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
      for (int64_t i = 0; i < K; i += 8) {
        const __m256 xv = _mm256_loadu_ps(xm + i);
        for (int r = 0; r < 8; ++r) a[r] = _mm256_add_ps(a[r], _mm256_mul_ps(xv, load8(wn + r * K + i)));
      }
      float* ym = y + m * N + n;
      for (int r = 0; r < 8; ++r) {
        _mm256_store_ps(lanes, a[r]);
        ym[r] = lane_sum(lanes) + (b ? b[n + r] : 0.f);
      }
    }
  }
  dense_rows_body(x, M, K, w, b, n, n1, N, y);
}
#else
template <typename WT>
void dense_rows_avx2(const float* x, int64_t M, int64_t K, const WT* w, const float* b, int64_t n0, int64_t n1,
                     int64_t N, float* y) {
  dense_rows_body(x, M, K, w, b, n0, n1, N, y);
}
#endif

constexpr int64_t DENSE_CHUNK = 64;      // weight rows per chunk of the thread split

// y [M, N] = x [M, K] w^T (+ bias), split across the threads by chunks of rows when the work pays for waking them
template <typename WT>
void dense_linear(const float* x, int64_t M, int64_t K, const WT* w, const float* bias, int64_t N, int path,
                  float* y) {
  const int64_t chunks = (N + DENSE_CHUNK - 1) / DENSE_CHUNK;
  auto fn = [&](int64_t c0, int64_t c1) {
    const int64_t n0 = c0 * DENSE_CHUNK, n1 = std::min(N, c1 * DENSE_CHUNK);
    if (path > 0) dense_rows_avx2<WT>(x, M, K, w, bias, n0, n1, N, y);
    else dense_rows_base<WT>(x, M, K, w, bias, n0, n1, N, y);
  };
  if (M * N * K < (int64_t(1) << 20)) return fn(0, chunks);
  leaplm_pool::parallel_for(chunks, std::max<int64_t>(1, chunks / (4 * int64_t(at::get_num_threads()))), fn);
}

// one dense linear: w [N, K] fp32 or bf16, and its bias (empty when absent)
struct DenseLinear {
  torch::Tensor w, bias;
  const float* b() const { return bias.numel() ? bias.data_ptr<float>() : nullptr; }
  void run(const float* x, int64_t M, int path, float* y) const {
    const int64_t N = w.size(0), K = w.size(1);
    if (w.scalar_type() == torch::kBFloat16)
      dense_linear(x, M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), b(), N, path, y);
    else
      dense_linear(x, M, K, w.data_ptr<float>(), b(), N, path, y);
  }
};

// w as a DenseLinear's weight: fp32 or bf16, contiguous, K a multiple of 8
inline torch::Tensor dense_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) % 8 == 0 &&
              (w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16),
              "dense weight: fp32 or bf16 [N, K], K a multiple of 8");
  return w.contiguous();
}

}  // namespace

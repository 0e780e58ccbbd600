// Probes for benchmarks and tests: each instruction's int8 multiply-add peak (registers only, no weight layout),
// the thread pool alone, and the activation quantization alone (returns qa [T, K] int8 and a [T, K / 32]).
#pragma once

#include <ATen/Parallel.h>

#include "activations.h"
#include "blocks_amx.h"
#include "common.h"
#include "pool.h"

namespace {

#if defined(__x86_64__)
// The int8 multiply-add rate one thread reaches with a path's dot-product instruction (16 independent chains, no
// memory traffic): the compute ceiling `leaplm bench --roofline` draws under the kernel's block-cost curve.
// 16 independent accumulators in registers (named, not an array: an array indexed in a loop stays on the stack,
// and the loop then measures a load and a store per instruction instead of the instruction)
#define LEAPLM_PEAK_BODY(STEP)                                                                     \
  const __m256i w = _mm256_set1_epi8(3), a = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);      \
  (void)a, (void)ones;                                                                               \
  __m256i c0 = _mm256_set1_epi32(0), c1 = _mm256_set1_epi32(1);                                      \
  __m256i c2 = _mm256_set1_epi32(2), c3 = _mm256_set1_epi32(3);                                      \
  __m256i c4 = _mm256_set1_epi32(4), c5 = _mm256_set1_epi32(5);                                      \
  __m256i c6 = _mm256_set1_epi32(6), c7 = _mm256_set1_epi32(7);                                      \
  __m256i c8 = _mm256_set1_epi32(8), c9 = _mm256_set1_epi32(9);                                      \
  __m256i c10 = _mm256_set1_epi32(10), c11 = _mm256_set1_epi32(11);                                  \
  __m256i c12 = _mm256_set1_epi32(12), c13 = _mm256_set1_epi32(13);                                  \
  __m256i c14 = _mm256_set1_epi32(14), c15 = _mm256_set1_epi32(15);                                  \
  for (int64_t it = 0; it < iters; ++it) {                                                           \
    c0 = STEP(c0); c1 = STEP(c1); c2 = STEP(c2); c3 = STEP(c3);                                      \
    c4 = STEP(c4); c5 = STEP(c5); c6 = STEP(c6); c7 = STEP(c7);                                      \
    c8 = STEP(c8); c9 = STEP(c9); c10 = STEP(c10); c11 = STEP(c11);                                  \
    c12 = STEP(c12); c13 = STEP(c13); c14 = STEP(c14); c15 = STEP(c15);                              \
    asm volatile("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5), "+x"(c6), "+x"(c7)); \
    asm volatile("" : "+x"(c8), "+x"(c9), "+x"(c10), "+x"(c11), "+x"(c12), "+x"(c13), "+x"(c14),       \
                 "+x"(c15));                                                                         \
  }                                                                                                  \
  return int64_t(_mm256_extract_epi32(c0, 0)) + _mm256_extract_epi32(c1, 0) + _mm256_extract_epi32(c2, 0) + \
         _mm256_extract_epi32(c3, 0) + _mm256_extract_epi32(c4, 0) + _mm256_extract_epi32(c5, 0) +    \
         _mm256_extract_epi32(c6, 0) + _mm256_extract_epi32(c7, 0) + _mm256_extract_epi32(c8, 0) +    \
         _mm256_extract_epi32(c9, 0) + _mm256_extract_epi32(c10, 0) + _mm256_extract_epi32(c11, 0) +  \
         _mm256_extract_epi32(c12, 0) + _mm256_extract_epi32(c13, 0) + _mm256_extract_epi32(c14, 0) + \
         _mm256_extract_epi32(c15, 0);

// AVX2: the accumulator is also the activation operand, so the multiply cannot be hoisted out of the loop
#define LEAPLM_STEP_AVX2(c) _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(w, c), ones))
#define LEAPLM_STEP_VNNI(c) _mm256_dpbusd_epi32(c, w, a)

__attribute__((target("avx2,fma,f16c"))) int64_t peak_avx2(int64_t iters) {
  LEAPLM_PEAK_BODY(LEAPLM_STEP_AVX2)
}

__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) int64_t peak_vnni(int64_t iters) {
  LEAPLM_PEAK_BODY(LEAPLM_STEP_VNNI)
}

// AMX: four independent 16 x 16 int32 products of 16 x 64 int8 tiles per round (4 x 16384 multiply-adds)
__attribute__((target("amx-tile,amx-int8"))) int64_t peak_amx(int64_t iters) {
  if (!amx_permitted()) return 0;
  TileScope tiles;
  tiles.use_square();
  alignas(64) int8_t a[16 * 64], b[16 * 64];
  alignas(64) int32_t out[16 * 16];
  std::memset(a, 1, sizeof a), std::memset(b, 2, sizeof b);
  LEAPLM_TILE_LOAD(4, a, 64);
  LEAPLM_TILE_LOAD(5, a, 64);
  LEAPLM_TILE_LOAD(6, b, 64);
  LEAPLM_TILE_LOAD(7, b, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  LEAPLM_TILE_STORE(0, out, 64);
  return out[0];
}
#endif

// Multiply-adds per second over all threads (int8 x int8 -> int32) for `path`, measured over `iters` rounds.
double int8_peak(int64_t path, int64_t iters) {
  TORCH_CHECK(path == AVX2 || path == AVX512VNNI || path == AMX, "int8_peak: path 1 (AVX2), 2 (AVX-512 VNNI) or 3 (AMX)");
#if defined(__x86_64__)
  const int threads = at::get_num_threads();
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<int64_t> sink{0};
  leaplm_pool::parallel_for(threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      sink += path == AMX ? peak_amx(iters) : path == AVX512VNNI ? peak_vnni(iters) : peak_avx2(iters);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (path == AMX && !amx_permitted()) return 0.0;
  return double(threads) * iters * (path == AMX ? 4 * 16 * 16 * 64 : 16 * 32) / s;
#else
  return 0.0;
#endif
}

// The thread pool alone (for tests): parallel_for over n items in chunks of `grain`, each item busy for `us`
// microseconds; returns, per item, the number of the thread that ran it (0 = the caller; -1 = never ran) and the
// number of times it ran. An item equal to `throw_at` throws inside its chunk.
std::vector<torch::Tensor> pool_probe(int64_t n, int64_t grain, int64_t us, int64_t throw_at) {
  static std::atomic<int> numbered{0};
  thread_local int me = -1;
  std::vector<int64_t> who(n, -1), runs(n, 0);
  const auto caller = std::this_thread::get_id();
  leaplm_pool::parallel_for(n, grain, [&](int64_t i0, int64_t i1) {
    if (me < 0 && std::this_thread::get_id() != caller) me = ++numbered;
    for (int64_t i = i0; i < i1; ++i) {
      TORCH_CHECK(i != throw_at, "pool_probe: item ", i, " throws");
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(us)) {
      }
      who[i] = std::this_thread::get_id() == caller ? 0 : me;
      ++runs[i];
    }
  });
  return {torch::tensor(who), torch::tensor(runs)};
}

// The activation quantization alone (for tests): (qa [T, K] int8, a [T, K / 32] fp32).
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) % QK == 0,
              "x: [T, K] contiguous fp32, K a multiple of 32");
  Act act;
  const int64_t T = x.size(0), K = x.size(1);
  quantize_act(x.data_ptr<float>(), int(T), K, act, int(path));
  auto qa = torch::from_blob(act.qa.data(), {T, K}, torch::kChar).clone();
  auto a = torch::from_blob(act.a.data(), {T, K / QK}, torch::kFloat).clone();
  return {qa, a};
}

}  // namespace

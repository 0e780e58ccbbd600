// Weight-only quantized linear for 1..16 tokens: y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]).
//
// Weights are blocks of 32 along k, as GGUF lays them out:
//   int8: q [N, K] int8,        w = q * scale[n, g]
//   int4: q [N, K / 2] uint8,   byte j of a block holds element j (low nibble) and j + 16 (high nibble),
//                               w = q * scale[n, g] + minv[n, g]
// Every weight block is read from memory once per call and applied to all T tokens while it sits in L1.
//
// Fixed reduction order: each (t, n) sums in 8 lanes (lane l takes k = 8 i + l), block by block, then the lanes
// are added in one fixed tree. The order depends on neither T nor the thread split, so a row's result is
// bit-identical whether computed alone or with 15 other rows. The scalar path emulates the same lanes with
// std::fma, so it agrees bit for bit with the AVX2 path too.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;
constexpr int MAX_T = 16;

// w[32] of one block, dequantized in fp32 (same arithmetic in both paths: one fma or one multiply).
inline void dequant_block_scalar(const int8_t* q8, const uint8_t* q4, float s, float m, float* w) {
  if (q8) {
    for (int j = 0; j < QK; ++j) w[j] = float(q8[j]) * s;
  } else {
    for (int j = 0; j < 16; ++j) {
      w[j] = std::fma(float(q4[j] & 0x0F), s, m);
      w[j + 16] = std::fma(float(q4[j] >> 4), s, m);
    }
  }
}

// Weights of one row as the kernel walks them: block g, chunk i (elements 8 i .. 8 i + 7 of the block).
struct Row {
  const int8_t* q8;
  const uint8_t* q4;
  const float* scale;
  const float* minv;
};

inline float lane_sum(const float* a) {   // fixed tree over 8 lanes: ((0+4)+(2+6)) + ((1+5)+(3+7))
  float s04 = a[0] + a[4], s15 = a[1] + a[5], s26 = a[2] + a[6], s37 = a[3] + a[7];
  return (s04 + s26) + (s15 + s37);
}

void row_scalar(const int8_t* q8, const uint8_t* q4, const float* scale, const float* minv, int G,
                const float* x, int64_t K, int T, float* out /* [T] */) {
  float acc[MAX_T][8] = {};
  float w[QK];
  for (int g = 0; g < G; ++g) {
    dequant_block_scalar(q8 ? q8 + g * QK : nullptr, q4 ? q4 + g * (QK / 2) : nullptr, scale[g],
                         minv ? minv[g] : 0.f, w);
    for (int t = 0; t < T; ++t) {
      const float* xt = x + t * K + g * QK;
      for (int j = 0; j < QK; ++j) acc[t][j & 7] = std::fma(w[j], xt[j], acc[t][j & 7]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = lane_sum(acc[t]);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma")))
inline __m256 dequant_chunk(const Row& r, int g, int i) {
  const __m256 vs = _mm256_set1_ps(r.scale[g]);
  if (r.q8) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.q8 + g * QK + 8 * i));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vs);
  }
  // chunk 0 / 1: low nibbles of bytes 0..7 / 8..15; chunk 2 / 3: their high nibbles (elements 16..31)
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.q4 + g * (QK / 2) + 8 * (i & 1)));
  if (i >= 2) b = _mm_srli_epi16(b, 4);
  b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), vs, _mm256_set1_ps(r.minv[g]));
}

// R rows x TT tokens of accumulators, one 8-lane accumulator per (row, token): R > 1 gives a lone token
// independent FMA chains (latency hidden); TT > 1 reuses each dequantized chunk for several tokens. Every
// (row, token) sees the same sequence of FMAs whatever R and TT are.
template <int R, int TT>
__attribute__((target("avx2,fma")))
void tile_avx2(const Row* rows, int G, const float* x, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 w = dequant_chunk(rows[r], g, i);
#pragma GCC unroll 8
        for (int t = 0; t < TT; ++t)
          acc[r][t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * K + g * QK + 8 * i), acc[r][t]);
      }
    }
  }
  alignas(32) float lanes[8];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      _mm256_store_ps(lanes, acc[r][t]);
      out[r * ldo + t] = lane_sum(lanes);
    }
}

// rows [n0, n1) x all T tokens; out [N, T] row-major
__attribute__((target("avx2,fma")))
void rows_avx2(const Row* all, int64_t n0, int64_t n1, int G, const float* x, int64_t K, int T, float* out) {
  int64_t n = n0;
  if (T < 4) {                       // few tokens: 4 rows at a time
    for (; n + 4 <= n1; n += 4) {
      float* o = out + n * T;
      if (T == 1) tile_avx2<4, 1>(all + n, G, x, K, o, T);
      else if (T == 2) tile_avx2<4, 2>(all + n, G, x, K, o, T);
      else tile_avx2<4, 3>(all + n, G, x, K, o, T);
    }
  }
  for (; n < n1; ++n) {
    int t = 0;
    float* o = out + n * T;
    for (; t + 8 <= T; t += 8) tile_avx2<1, 8>(all + n, G, x + t * K, K, o + t, T);
    if (t + 4 <= T) { tile_avx2<1, 4>(all + n, G, x + t * K, K, o + t, T); t += 4; }
    if (t + 2 <= T) { tile_avx2<1, 2>(all + n, G, x + t * K, K, o + t, T); t += 2; }
    if (t < T) tile_avx2<1, 1>(all + n, G, x + t * K, K, o + t, T);
  }
}
#endif

// x [T, K] fp32 contiguous, T <= 16; returns [T, N].
torch::Tensor qlinear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor minv,
                      c10::optional<torch::Tensor> bias, bool int4, bool avx2) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [T, K] contiguous fp32");
  const int64_t T = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(T >= 1 && T <= MAX_T, "qlinear takes 1..16 tokens, got ", T);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == torch::kFloat, "layout");
  TORCH_CHECK(int4 ? (q.scalar_type() == torch::kUInt8 && q.size(1) == K / 2)
                   : (q.scalar_type() == torch::kChar && q.size(1) == K), "q: wrong dtype or shape");
  TORCH_CHECK(scale.size(0) == N && scale.size(1) == K / QK, "scale: [N, K/32]");
  if (int4) TORCH_CHECK(minv.is_contiguous() && minv.sizes() == scale.sizes(), "minv: [N, K/32]");
#if !defined(__x86_64__)
  avx2 = false;
#endif
  auto y_nt = torch::empty({N, T}, x.options());   // row-major per weight row: one contiguous write per row
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = int4 ? minv.data_ptr<float>() : nullptr;
  float* yp = y_nt.data_ptr<float>();
  const int G = K / QK;
  const int64_t rowbytes = int4 ? K / 2 : K;
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  std::vector<Row> rows(N);
  for (int64_t n = 0; n < N; ++n)
    rows[n] = Row{int4 ? nullptr : reinterpret_cast<const int8_t*>(qp + n * rowbytes), int4 ? qp + n * rowbytes : nullptr,
                  sp + n * G, mp ? mp + n * G : nullptr};
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#if defined(__x86_64__)
    if (avx2) { rows_avx2(rows.data(), n0, n1, G, xp, K, T, yp); return; }
#endif
    for (int64_t n = n0; n < n1; ++n)
      row_scalar(rows[n].q8, rows[n].q4, rows[n].scale, rows[n].minv, G, xp, K, T, yp + n * T);
  });
  auto y = y_nt.t().contiguous();                   // [T, N]
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "weight-only int8/int4 linear for 1..16 tokens (fixed reduction order)");
}

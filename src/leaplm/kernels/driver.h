// The row-group driver: a linear's packed weight (common.h W: row groups of 8 rows, [N/8, G, ...]) split across
// the kernel's threads (pool.h) in chunks of whole row groups (an even count: the AVX-512 pairs stay whole), each
// chunk through one path's block products (run_groups, the one dispatch); the tokens of one row group in tiles
// (AVX2: 4, VNNI: 8 tokens) and the blocks in chunks that keep the activations in L1. Entry points: linear_raw
// (any token count, a linear in several parts), qlinear (the Python one, 1..32 tokens) and qlinear_argmax (its
// per-token argmax, for a greedy output layer, without writing the outputs).
#pragma once

#include <ATen/Parallel.h>

#include "activations.h"
#include "blocks_amx.h"
#include "blocks_avx2.h"
#include "blocks_scalar.h"
#include "blocks_vnni.h"
#include "common.h"
#include "pool.h"
#include "timers.h"

namespace {

#if defined(__x86_64__)
template <int TT, bool VNNI>
inline void tile(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  if (w.half) {
    if constexpr (VNNI) group_vnni_half<TT>(w, act, grp, t0, ga, gb, accp);
    else group_avx2_half<TT>(w, act, grp, t0, ga, gb, accp);
  } else if constexpr (VNNI) {
    group_vnni<TT>(w, act, grp, t0, ga, gb, accp);
  } else {
    group_avx2<TT>(w, act, grp, t0, ga, gb, accp);
  }
}

// the last `rem` (<= TT) tokens in one tile of exactly that width
template <int TT, bool VNNI>
inline void tail(int rem, const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  if constexpr (TT >= 1) {
    if (rem == TT) tile<TT, VNNI>(w, act, grp, t0, ga, gb, accp);
    else tail<TT - 1, VNNI>(rem, w, act, grp, t0, ga, gb, accp);
  }
}

// All T tokens of one row group in token tiles of at most TMAX (the unpacked block stays in 8 registers and
// each token adds an int32 and an fp32 accumulator: AVX2 has 16 vector registers, AVX-512 32), the blocks in
// chunks that keep the activations in L1. A token's sum runs over g = 0, 1, ..., G - 1 in order whatever the
// chunks and tiles (the partial sums wait in `accs`, unrounded fp32), so the bits do not depend on T.
template <bool VNNI>
void group_simd(const W& w, const Act& act, int64_t grp, float* y) {
  constexpr int TMAX = VNNI ? 8 : 4;
  alignas(32) float accs[MAX_T * 8];
  std::memset(accs, 0, sizeof(float) * 8 * act.T);
  const int G = w.G;
  const int chunk = act.T <= TMAX ? G : std::max(1, ACT_L1_BYTES / (QK * act.T));
  for (int ga = 0; ga < G; ga += chunk) {
    const int gb = std::min(G, ga + chunk);
    int t = 0;
    for (; t + TMAX <= act.T; t += TMAX) tile<TMAX, VNNI>(w, act, grp, t, ga, gb, accs + 8 * t);
    if (t < act.T) tail<TMAX - 1, VNNI>(act.T - t, w, act, grp, t, ga, gb, accs + 8 * t);
  }
  store_group(w, act, grp, accs, y);
}
#endif

// Row groups per chunk of a linear's thread split: about 8 chunks per thread, so a thread that starts late or is
// descheduled leaves little for the others to wait on, and each chunk is still many blocks of work.
// An even count, so the AVX-512 path's pairs of groups stay whole.
int64_t group_grain(int64_t groups) {
  const int64_t g = std::max<int64_t>(1, groups / (8 * int64_t(at::get_num_threads())));
  return g + (g & 1);
}

void run_groups(const W& w, const Act& act, int path, int64_t g0, int64_t g1, float* y) {
#if defined(__x86_64__)
  if (path == AMX && !w.half && amx_for(w.int4, act.T) && amx_permitted()) {
    TileScope tiles;
    int64_t grp = g0;
    for (; grp + 1 < g1; grp += 2) pair_amx_simd(w, act, grp, y, tiles);
    if (grp < g1) group_simd<true>(w, act, grp, y);
    return;
  }
#endif
  for (int64_t grp = g0; grp < g1; ++grp) {
#if defined(__x86_64__)
    if (path >= AVX512VNNI && act.T >= PAIR_MIN_T && grp + 1 < g1) { pair_simd(w, act, grp++, y); continue; }
    if (path >= AVX512VNNI) { group_simd<true>(w, act, grp, y); continue; }
    if (path == AVX2) { group_simd<false>(w, act, grp, y); continue; }
#endif
    group_scalar(w, act, grp, y);
  }
}

// y [M, N] = x [M, K] through the packed weights ws, their rows side by side (a linear whose row blocks are held in
// different formats: q/k/v of a Q4_K_M file), any M (32 tokens per kernel call); bias (N floats) or null. Each
// row's result is its part's alone: the parts share only the quantized activations.
void linear_raw(const float* x, int64_t M, int64_t K, const std::vector<W>& ws, const float* bias, int path,
                float* y) {
  // the calling thread's buffers, kept between calls (no allocation per linear); a reference, so that the pool's
  // workers read the caller's activations, not a thread_local of their own
  static thread_local Act buffers;
  Act& act = buffers;
  const int64_t N = ws[0].ldy;
  for (int64_t m0 = 0; m0 < M; m0 += MAX_T) {
    const int T = int(std::min<int64_t>(MAX_T, M - m0));
    quantize_act(x + m0 * K, T, K, act, path);
    int64_t col = 0;
    for (const W& w : ws) {
      float* yc = y + m0 * N + col;
      const int64_t NG = (w.N + RG - 1) / RG;
      leaplm_pool::parallel_for(NG, group_grain(NG),
                                [&](int64_t g0, int64_t g1) { run_groups(w, act, path, g0, g1, yc); });
      col += w.N;
    }
  }
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
}

// The packed weight W of qp, sp, mp (common.h's layout) for x [T, K] fp32 contiguous, T <= 32, after checking
// every shape and type; the path checked too (and taken as SCALAR off x86).
W packed_view(const torch::Tensor& x, const torch::Tensor& qp, const torch::Tensor& sp,
              const c10::optional<torch::Tensor>& mp, int64_t N, int64_t& path,
              const c10::optional<torch::Tensor>& ss = c10::nullopt,
              const c10::optional<torch::Tensor>& ms = c10::nullopt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [T, K] contiguous fp32");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(T >= 1 && T <= MAX_T, "qlinear takes 1..", MAX_T, " tokens, got ", T);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  const bool int4 = mp.has_value();
  const int64_t G = K / QK, NG = (N + RG - 1) / RG;
  const bool half = !int4 && sp.numel() == 2 * NG * G * RG;        // int6: a scale per half block
  const int64_t width = int4 ? 128 : half ? 192 : 256;
  TORCH_CHECK(qp.is_contiguous() && qp.scalar_type() == torch::kUInt8 && qp.numel() == NG * G * width,
              "qp: packed uint8 [N/8, G, ", width, "]");
  const bool s16 = sp.scalar_type() == torch::kHalf;
  const bool factored = ss.has_value();                           // K-quants: int8 multiples of fp16 super scales
  const auto supers = [&](const torch::Tensor& t, const char* what) {
    TORCH_CHECK(G % 8 == 0 && t.is_contiguous() && t.scalar_type() == torch::kHalf && t.numel() == NG * (G / 8) * RG,
                what, ": fp16 [N/8, G/8, 8] (K a multiple of 256)");
  };
  if (factored) {
    supers(*ss, "ss");
    TORCH_CHECK(sp.is_contiguous() && sp.scalar_type() == torch::kChar && (half || sp.numel() == NG * G * RG),
                "sp: int8 [N/8, G, 8] (int6: [N/8, G, 2, 8]) with ss");
  } else {
    TORCH_CHECK(sp.is_contiguous() && (sp.scalar_type() == torch::kFloat || (s16 && !half)) &&
                    (half || sp.numel() == NG * G * RG),
                "sp: fp32 or fp16 [N/8, G, 8] (int6: fp32 [N/8, G, 2, 8])");
  }
  // mp of one element: every minimum is that multiple of its scale (Q4_0: -8), none stored
  const bool shared_min = int4 && mp->numel() == 1;
  TORCH_CHECK(!ms.has_value() || (int4 && !shared_min), "ms: only with stored minimums");
  if (ms.has_value()) supers(*ms, "ms");
  if (int4 && !shared_min)
    TORCH_CHECK(mp->is_contiguous() && mp->scalar_type() == sp.scalar_type() && mp->numel() == NG * G * RG &&
                    ms.has_value() == factored,
                "mp: [N/8, G, 8] in sp's type (int8 with ms where sp has ss), or one multiplier of the scales");
  TORCH_CHECK(path >= SCALAR && path <= AMX, "path: 0 scalar, 1 AVX2, 2 AVX-512 VNNI, 3 AMX");
  TORCH_CHECK(path != AMX || amx_permitted(), "path 3 (AMX): the operating system does not grant the tile registers");
#if !defined(__x86_64__)
  path = SCALAR;
#endif
  W w{qp.data_ptr<uint8_t>(), sp.data_ptr(), int4 && !shared_min ? mp->data_ptr() : nullptr, N, int(G), int4, half,
      N, s16};
  if (shared_min) w.mk = one_value(*mp);
  if (factored) w.ss = reinterpret_cast<const uint16_t*>(ss->data_ptr());
  if (ms.has_value()) w.ms = reinterpret_cast<const uint16_t*>(ms->data_ptr());
  return w;
}

// x [T, K] fp32 contiguous (T <= 32); qp, sp, mp packed as common.h describes; returns y [T, N].
torch::Tensor qlinear(torch::Tensor x, torch::Tensor qp, torch::Tensor sp, c10::optional<torch::Tensor> mp,
                      c10::optional<torch::Tensor> bias, int64_t N, int64_t path,
                      c10::optional<torch::Tensor> ss, c10::optional<torch::Tensor> ms) {
  const W w = packed_view(x, qp, sp, mp, N, path, ss, ms);
  const int64_t T = x.size(0), NG = (N + RG - 1) / RG;
  Span span(R_QLINEAR);
  Act act;
  quantize_act(x.data_ptr<float>(), int(T), x.size(1), act, int(path));
  auto y = torch::empty({T, N}, x.options());
  float* yp = y.data_ptr<float>();
  leaplm_pool::parallel_for(NG, group_grain(NG),
                            [&](int64_t g0, int64_t g1) { run_groups(w, act, int(path), g0, g1, yp); });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// ---- argmax over a linear's outputs (a greedy output layer) ----------------------------------------------------
// Row groups per slab of qlinear_argmax: a slab's outputs [T, 8 x 64] (at most 64 KiB) stay in L2 between the
// products that write them and the scan that reduces them. Even, so the AVX-512 and AMX pairs stay whole.
constexpr int64_t ARGMAX_SLAB = 64;

// a above b in torch.argmax's order: NaN above every number
LEAPLM_INLINE bool above(float a, float b) { return a > b || (std::isnan(a) && !std::isnan(b)); }

// For each token t, (max_n y[t, n], the first n reaching it) of y = qlinear(x, ...) without writing y: the row groups
// in slabs of ARGMAX_SLAB, each slab computed by run_groups into a per-thread buffer (the same products, so the same
// bits as qlinear's y, bias added the same way) and reduced there, the slabs merged in order. Ties go to the lowest
// index and a NaN counts above every number, as torch.argmax over qlinear's y. Returns (values fp32 [T], indices
// int64 [T]).
std::vector<torch::Tensor> qlinear_argmax(torch::Tensor x, torch::Tensor qp, torch::Tensor sp,
                                          c10::optional<torch::Tensor> mp, c10::optional<torch::Tensor> bias,
                                          int64_t N, int64_t path, c10::optional<torch::Tensor> ss,
                                          c10::optional<torch::Tensor> ms) {
  const W w = packed_view(x, qp, sp, mp, N, path, ss, ms);
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat && bias->numel() == N, "bias: fp32 [N]");
  const int T = int(x.size(0));
  const int64_t NG = (N + RG - 1) / RG, slabs = (NG + ARGMAX_SLAB - 1) / ARGMAX_SLAB;
  Span span(R_QLINEAR);
  Act act;
  quantize_act(x.data_ptr<float>(), T, x.size(1), act, int(path));
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  std::vector<float> best(slabs * T);              // [slabs, T]: each slab's maximum per token
  std::vector<int64_t> where(slabs * T);           // [slabs, T]: where it first occurs
  const int64_t sbytes = w.scale_bytes() * RG * w.G * (w.half ? 2 : 1);   // one row group's scales
  const int64_t mbytes = w.scale_bytes() * RG * w.G;                      // and minimums
  auto slab = [&](int64_t c0, int64_t c1) {
    static thread_local std::vector<float> buf;    // [T, 8 x slab], kept between calls
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g0 = c * ARGMAX_SLAB, g1 = std::min(NG, g0 + ARGMAX_SLAB), n0 = g0 * RG;
      W ws = w;                                    // the slab's row groups as a matrix of their own
      ws.q = w.q + g0 * w.G * w.block_bytes();
      ws.s = static_cast<const uint8_t*>(w.s) + g0 * sbytes;
      ws.m = w.m ? static_cast<const uint8_t*>(w.m) + g0 * mbytes : nullptr;
      ws.ss = w.ss ? w.ss + g0 * (w.G / 8) * RG : nullptr;
      ws.ms = w.ms ? w.ms + g0 * (w.G / 8) * RG : nullptr;
      ws.N = std::min(N, g1 * RG) - n0;
      ws.ldy = (g1 - g0) * RG;
      buf.resize(size_t(T) * ws.ldy);
      run_groups(ws, act, int(path), 0, g1 - g0, buf.data());
      for (int t = 0; t < T; ++t) {
        const float* yt = buf.data() + t * ws.ldy;
        float m = b ? yt[0] + b[n0] : yt[0];
        int64_t i = 0;
        for (int64_t r = 1; r < ws.N; ++r) {
          const float v = b ? yt[r] + b[n0 + r] : yt[r];
          if (above(v, m)) m = v, i = r;
        }
        best[c * T + t] = m;
        where[c * T + t] = n0 + i;
      }
    }
  };
  const int64_t grain = std::max<int64_t>(1, slabs / (8 * int64_t(at::get_num_threads())));
  leaplm_pool::parallel_for(slabs, grain, slab);
  auto values = torch::empty({T}, x.options());
  auto index = torch::empty({T}, x.options().dtype(torch::kLong));
  float* vp = values.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  for (int t = 0; t < T; ++t) {                    // slabs in order: a later slab wins only by being above
    vp[t] = best[t];
    ip[t] = where[t];
    for (int64_t c = 1; c < slabs; ++c)
      if (above(best[c * T + t], vp[t])) vp[t] = best[c * T + t], ip[t] = where[c * T + t];
  }
  return {values, index};
}

}  // namespace

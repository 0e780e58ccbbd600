// The int8 kernel's shared vocabulary: the block formats of a packed weight, its row groups, the token counts of one
// call, the instruction-set paths and the weight view W every block product reads. One part of the unity build
// that qlinear.cpp compiles (see there); the parts include what they use, in this order of dependence:
//   common.h, timers.h -> activations.h -> blocks_scalar.h, blocks_avx2.h -> blocks_vnni.h -> blocks_amx.h
//   -> driver.h (row groups over pool.h's threads) -> probes.h; layer_math.h, dense.h -> decoder.h
//
// Weights are blocks of 32 along k, as GGUF stores them (the integers unchanged; scales and mins in fp32 or fp16):
//   int8 (Q8_0, Q5_0):  w[n, g, j] = q[n, g, j] * s[n, g],          q in -128..127
//   int4 (Q4_0, Q4_1, Q4_K): w[n, g, j] = q[n, g, j] * s[n, g] + m[n, g], q in 0..15   (Q4_0: m = -8 s)
//   int6 (Q6_K):        w[n, g, j] = q[n, g, j] * s[n, g, j / 16],   q in -32..31, a scale per half block
// At load the rows are repacked in groups of 8 so that one 8-lane vector holds the same 4 weights of 8 rows
// (quant/linear.py, `pack`):
//   int8  qp [N/8, G, 8 chunks, 8 rows, 4 bytes]: chunk c = elements 4c .. 4c+3 of the block
//   int4  qp [N/8, G, 4 chunks, 8 rows, 4 bytes]: GGUF's nibble bytes 4c .. 4c+3; the low nibbles are elements
//         4c .. 4c+3, the high nibbles elements 16+4c .. 16+4c+3
//   int6  qp [N/8, G, 192]: u = q + 32 (0..63) in 6 bits, as the file holds them (quant/linear.py, pack_int6):
//         bytes 0..127 the low 4 bits of u in int4's nibble chunks; bytes 128..191 [2 h, 8 rows, 4 bytes i] the top
//         2 bits, those of element 4 (4h + k) + i at bits 2k, 2k + 1 of byte (h, r, i)
//   sp, mp [N/8, G, 8 rows] fp32 or fp16 (int6: sp [N/8, G, 2 halves, 8 rows] fp32)
//   K-quants (Q4_K, Q6_K): sp, mp int8, each an integer multiple of a super-block scale that ss, ms hold in fp16
//   ([N/8, G/8, 8]: one per row and 256 weights, as the file holds d and dmin); the product is exact in fp32, so the
//   same numbers in 1 byte a block and row rather than 4
//   Q4_0's minimums are -8 times its scales: no mp is stored, W.mk = -8 and m = mk * s (exact: a power of two times
//   a widened fp16), so a forward reads the file's 18 bytes a block rather than 20
// Activations are quantized per token and per block of 32 to int8 (round half to even, scale a = amax / 127),
// once per call; then every weight block is read from memory once for all T tokens. The arithmetic of one
// (row n, token t), in this order whatever T, the tiling, the thread split or the instruction set:
//   P[g]  = sum_j q[n, g, j] * qa[t, g, j]                         int32, exact
//   acc   = fma(float(P[g]), s[n, g] * a[t, g], acc)                for g = 0, 1, ..., G - 1
//           (int6: P[g] in two halves of 16, fma(float(P_lo), s_lo * a, acc) then fma(float(P_hi), s_hi * a, acc))
//   mt    = fma(m[n, g], a[t, g] * float(sum_j qa[t, g, j]), mt)    for g = 0, 1, ..., G - 1 (int4 only)
//   y     = acc + mt
// A row's result is therefore bit-identical alone or with 15 other rows, and every path (scalar, AVX2, AVX-512
// VNNI) gives the same bits: the scalar path is the reference the SIMD paths are checked against.
//
// A linear's output rows are split across threads by whole row groups (driver.h); the AVX-512 and AMX paths take
// row groups in pairs (16 rows: the two groups' block g at q and q + G * block bytes).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int QK = 32;
constexpr int MAX_T = 32;
constexpr int RG = 8;            // rows per packed group
// The AVX-512 path takes row groups in pairs from this many tokens: below it, SmolLM2 Q4_1's whole forward
// measured slower with pairs than with single groups (2 threads, T = 1: 4.66 against 3.64 ms), from 8 faster
// (T = 16: 15.0 against 17.8 ms).
constexpr int PAIR_MIN_T = 8;
// The block sizes T (bit T, 1..32) whose linears the AMX path runs as tile products, per weight format ([0] int8,
// [1] int4); the others as the AVX-512 VNNI path's instructions. The bits are the same either way, so the build's
// start-up tuning (kernels/build.py, tune_amx) sets what it measured faster on this machine; until then, tile
// products only for whole tiles (16 and 32 tokens).
std::atomic<uint64_t> AMX_TOKENS[2] = {(1ull << 16) | (1ull << 32), (1ull << 16) | (1ull << 32)};

bool amx_for(bool int4, int T) { return (AMX_TOKENS[int4].load(std::memory_order_relaxed) >> T) & 1; }

enum Path : int { SCALAR = 0, AVX2 = 1, AVX512VNNI = 2, AMX = 3 };   // AMX: AVX-512 VNNI, and tiles for blocks

// Linux hands AMX's tile registers to a process only when it asks (arch_prctl), once; elsewhere, and where it
// refuses, path 3 is refused at the entry points (the path probe then picks AVX-512 VNNI).
bool amx_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

#define LEAPLM_INLINE __attribute__((always_inline)) inline

// One packed weight matrix.
struct W {
  const uint8_t* q;      // int8: [N/8, G, 8, 8, 4] (signed bytes); int4: [N/8, G, 4, 8, 4]; int6: [N/8, G, 192]
  const void* s;         // [N/8, G, 8] fp32, or fp16 (s16) | int6: [N/8, G, 2, 8] fp32
  const void* m;         // [N/8, G, 8] (int4), in s's type; or null
  int64_t N;             // rows written (the packed matrix may have up to 7 zero rows more)
  int G;
  bool int4;
  bool half;             // int6: 6-bit integers with a scale per half block (16 weights)
  int64_t ldy;           // floats between output rows of y (N, or more when this matrix is a part of a wider y)
  bool s16;              // scales and minimums in fp16, as a GGUF file holds Q8_0's, Q4_0's and Q4_1's: read in
                         // fewer bytes and widened exactly, so every product is the fp32 one's
  float mk = 0.f;        // int4 with m null: every minimum is mk times its scale (Q4_0: -8)
  const uint16_t* ss = nullptr;   // K-quants: s holds int8 multiples of these fp16 super-block scales [N/8, G/8, 8]
  const uint16_t* ms = nullptr;   // and m int8 multiples of these (Q4_K: -dmin)
  int64_t block_bytes() const { return int4 ? 128 : half ? 192 : 256; }   // one block of 8 rows
  int64_t scale_bytes() const { return ss ? 1 : s16 ? 2 : 4; }
  // where scale index i's super-block scale lies: 8 blocks (int6: 16 half blocks) of 8 rows share one row of 8
  int64_t super_of(int64_t i) const { return ((i >> (half ? 7 : 6)) << 3) | (i & 7); }
};

inline float half_at(const uint16_t* p, int64_t i) { return c10::detail::fp16_ieee_to_fp32_value(p[i]); }

// scale or minimum i of `base` (w.s or w.m; sup: w.ss or w.ms) as fp32 (an fp16 one widened, an int8 multiple of a
// widened fp16: exact)
inline float scale_at(const W& w, const void* base, const uint16_t* sup, int64_t i) {
  if (sup) return float(static_cast<const int8_t*>(base)[i]) * half_at(sup, w.super_of(i));
  return w.s16 ? half_at(static_cast<const uint16_t*>(base), i) : static_cast<const float*>(base)[i];
}

inline float scale_of(const W& w, int64_t i) { return scale_at(w, w.s, w.ss, i); }

// the value of a one-element fp32 or fp16 tensor (a shared minimum's multiple: mp of one element), read in place
inline float one_value(const torch::Tensor& t) {
  TORCH_CHECK(t.numel() == 1 && (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kHalf),
              "mp of one element: fp32 or fp16");
  return t.scalar_type() == torch::kHalf ? half_at(static_cast<const uint16_t*>(t.data_ptr()), 0)
                                         : *static_cast<const float*>(t.data_ptr());
}

// minimum i of an int4 weight as fp32: stored, or mk times the scale
inline float min_at(const W& w, int64_t i) { return w.m ? scale_at(w, w.m, w.ms, i) : w.mk * scale_of(w, i); }

// Blocks of 32 per pass over the tokens: the int8 activations one pass reads (T x blocks x 32 bytes) stay within
// about half of a 32 KiB L1 data cache beside the group's weights, so a block's weights are read from L1 by every
// token tile and no tile evicts the next one's activations.
constexpr int ACT_L1_BYTES = 16384;
constexpr int PAIR_TMAX = 8;      // tokens per tile of a pair of groups (16 measured the same on SmolLM2's shapes)

}  // namespace

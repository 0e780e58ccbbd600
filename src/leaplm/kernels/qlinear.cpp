// Quantized linear for 1..32 tokens with 8-bit integer dot products: y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]).
//
// Weights are blocks of 32 along k, as GGUF stores them (the integers unchanged; scales and mins in fp32):
//   int8 (Q8_0, Q5_0):  w[n, g, j] = q[n, g, j] * s[n, g],          q in -128..127
//   int4 (Q4_0, Q4_1, Q4_K): w[n, g, j] = q[n, g, j] * s[n, g] + m[n, g], q in 0..15   (Q4_0: m = -8 s)
//   int6 (Q6_K):        w[n, g, j] = q[n, g, j] * s[n, g, j / 16],   q in -32..31: int8 with a scale per half block
// At load the rows are repacked in groups of 8 so that one 8-lane vector holds the same 4 weights of 8 rows
// (quant/linear.py, `pack`):
//   int8  qp [N/8, G, 8 chunks, 8 rows, 4 bytes]: chunk c = elements 4c .. 4c+3 of the block
//   int4  qp [N/8, G, 4 chunks, 8 rows, 4 bytes]: GGUF's nibble bytes 4c .. 4c+3; the low nibbles are elements
//         4c .. 4c+3, the high nibbles elements 16+4c .. 16+4c+3
//   sp, mp [N/8, G, 8 rows] fp32 (int6: sp [N/8, G, 2 halves, 8 rows])
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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "pool.h"
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
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

// ---- region timers ----------------------------------------------------------------------------------------------
// With LEAPLM_KERNEL_PROFILE=1 in the environment when the library loads, the layer loop and qlinear sum the wall
// time of each region over every call (`profile()` reads the sums, `profile_reset()` clears them); otherwise a
// region costs one predictable branch. A linear's region includes its activation quantization, which is also
// counted alone under "quantize".
enum Region : int { R_NORM, R_QUANT, R_QKV, R_ROPE, R_ATTN, R_O, R_GATE_UP, R_SILU, R_DOWN, R_RESID, R_QLINEAR, R_COUNT };
const char* const REGION_NAMES[R_COUNT] = {"norm", "quantize", "qkv", "rope_cache", "attention", "o", "gate_up",
                                           "silu", "down", "residual", "qlinear"};

struct Profile {
  const bool on = [] {
    const char* v = std::getenv("LEAPLM_KERNEL_PROFILE");
    return v != nullptr && v[0] == '1';
  }();
  std::atomic<int64_t> ns[R_COUNT] = {};
  std::atomic<int64_t> calls[R_COUNT] = {};
};

Profile& profile_state() {
  static Profile p;
  return p;
}

class Span {                     // times its scope into a region when profiling is on
 public:
  explicit Span(Region r) : r_(r), on_(profile_state().on) {
    if (on_) t0_ = std::chrono::steady_clock::now();
  }
  ~Span() {
    if (!on_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_);
    profile_state().ns[r_].fetch_add(ns.count(), std::memory_order_relaxed);
    profile_state().calls[r_].fetch_add(1, std::memory_order_relaxed);
  }

 private:
  Region r_;
  bool on_;
  std::chrono::steady_clock::time_point t0_;
};

// The activations of one call, quantized: qa [T, K] int8; a, sa [T, G] fp32 (sa = a * sum of the block's qa);
// sq [T, G] int32 (sum of the block's qa); sq16 [T, G] int32 (sum of its first 16 qa).
// The AVX-512 path reads the same values block-major (qab [G, T, 32], ab [G, T], sqb [G, T]): the tokens of one
// block at fixed offsets from one pointer.
struct Act {
  std::vector<int8_t> qa;
  std::vector<float> a, sa;
  std::vector<int32_t> sq, sq16;
  std::vector<int8_t> qab;
  std::vector<float> ab;
  std::vector<int32_t> sqb;
  int T;
  int64_t K;
  int G;
};

#define LEAPLM_INLINE __attribute__((always_inline)) inline

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

// One packed weight matrix.
struct W {
  const uint8_t* q;      // int8: [N/8, G, 8, 8, 4] (signed bytes); int4: [N/8, G, 4, 8, 4]
  const void* s;         // [N/8, G, 8] fp32, or fp16 (s16) | int6: [N/8, G, 2, 8] fp32
  const void* m;         // [N/8, G, 8] (int4), in s's type; or null
  int64_t N;             // rows written (the packed matrix may have up to 7 zero rows more)
  int G;
  bool int4;
  bool half;             // int6: int8 integers with a scale per half block (16 weights)
  int64_t ldy;           // floats between output rows of y (N, or more when this matrix is a part of a wider y)
  bool s16;              // scales and minimums in fp16, as a GGUF file holds Q8_0's, Q4_0's and Q4_1's: read in
                         // fewer bytes and widened exactly, so every product is the fp32 one's
  int64_t block_bytes() const { return int4 ? 128 : 256; }   // one block of 8 rows
  int64_t scale_bytes() const { return s16 ? 2 : 4; }
};

// scale or minimum i of `base` (w.s or w.m) as fp32 (an fp16 one widened: exact)
inline float scale_at(const W& w, const void* base, int64_t i) {
  return w.s16 ? c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(base)[i])
               : static_cast<const float*>(base)[i];
}

// ---- scalar reference ------------------------------------------------------------------------------------------
inline int weight_at(const W& w, int64_t grp, int g, int r, int j) {   // q[8 grp + r, g, j]
  const uint8_t* b = w.q + (grp * w.G + g) * w.block_bytes();
  if (!w.int4) return int(int8_t(b[((j / 4) * RG + r) * 4 + j % 4]));
  const int e = j % 16;
  const uint8_t byte = b[((e / 4) * RG + r) * 4 + e % 4];
  return j < 16 ? (byte & 0x0F) : (byte >> 4);
}

void group_scalar(const W& w, const Act& act, int64_t grp, float* y) {
  const int G = w.G;
  for (int r = 0; r < RG; ++r) {
    const int64_t n = grp * RG + r;
    if (n >= w.N) break;
    for (int t = 0; t < act.T; ++t) {
      float acc = 0.f, mt = 0.f;
      for (int g = 0; g < G; ++g) {
        const int8_t* qa = act.qa.data() + t * act.K + g * QK;
        const size_t sg = (grp * G + g) * RG + r;
        if (w.half) {
          int32_t p[2] = {0, 0};
          for (int j = 0; j < QK; ++j) p[j / 16] += weight_at(w, grp, g, r, j) * int32_t(qa[j]);
          const size_t sh = (grp * G + g) * 2 * RG + r;
          acc = std::fma(float(p[0]), scale_at(w, w.s, sh) * act.a[t * G + g], acc);
          acc = std::fma(float(p[1]), scale_at(w, w.s, sh + RG) * act.a[t * G + g], acc);
          continue;
        }
        int32_t p = 0;
        for (int j = 0; j < QK; ++j) p += weight_at(w, grp, g, r, j) * int32_t(qa[j]);
        acc = std::fma(float(p), scale_at(w, w.s, sg) * act.a[t * G + g], acc);
        if (w.m) mt = std::fma(scale_at(w, w.m, sg), act.sa[t * G + g], mt);
      }
      y[t * w.ldy + n] = acc + mt;
    }
  }
}

#if defined(__x86_64__)
// ---- SIMD paths: lane r of every vector is row 8 grp + r ------------------------------------------------------
// The weights of block g as 8 vectors of unsigned bytes, vector c holding elements 4c .. 4c+3 of the 8 rows
// (int8: the signed bytes + 128, corrected by 128 * sum(qa) after the dot product; int4: the nibbles as stored).
__attribute__((target("avx2,fma,f16c"))) inline void load_block(const W& w, const uint8_t* b, __m256i* u) {
  if (w.int4) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * c));
      u[c] = _mm256_and_si256(v, nib);
      u[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    }
  } else {
    for (int c = 0; c < 8; ++c) u[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * c));
  }
}

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

// int6: the two halves' products (chunks 0 .. 3 hold elements 0 .. 15, chunks 4 .. 7 elements 16 .. 31), exact
// int32; u as for int8 (the signed bytes + 128), each half corrected by 128 * its sum of qa.
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

// int6 on AVX2: the sign moves onto the activation as for int8; |w| <= 32, so a half's 4 maddubs results add in
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

// 8 scales or minimums of `base` (w.s or w.m) from index i, as fp32
__attribute__((target("avx2,f16c"))) LEAPLM_INLINE __m256 load8(const W& w, const void* base, int64_t i) {
  if (w.s16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(base) + i);
}

// the 16 of row groups grp and grp + 1 (their block g at i and i + next)
__attribute__((target("avx2,f16c,avx512f,avx512dq"))) LEAPLM_INLINE __m512 load16(const W& w, const void* base, int64_t i,
                                                                                   int64_t next) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(load8(w, base, i)), load8(w, base, i + next), 1);
}

#define LEAPLM_GROUP_BODY_HALF(DOT2)                                                                            \
  const int G = w.G;                                                                                            \
  const int64_t K = act.K;                                                                                      \
  __m256 acc[TT];                                                                                               \
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_load_ps(accp + 8 * t);                                           \
  const __m256i k128 = _mm256_set1_epi8(char(0x80));                                                            \
  for (int g = ga; g < gb; ++g) {                                                                               \
    __m256i u[8];                                                                                               \
    prefetch_ahead(w, (grp * G + g) * w.block_bytes(), (grp * G + g) * 2 * RG);                                \
    load_block(w, w.q + (grp * G + g) * w.block_bytes(), u);                                                    \
    for (int c = 0; c < 8; ++c) u[c] = _mm256_xor_si256(u[c], k128);                                           \
    const float* sp = static_cast<const float*>(w.s) + (grp * G + g) * 2 * RG;   /* int6: fp32 scales */          \
    const __m256 slo = _mm256_loadu_ps(sp), shi = _mm256_loadu_ps(sp + RG);                                     \
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
    const __m256 sv = load8(w, w.s, (grp * G + g) * RG);                                                        \
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
  if (w.m)
    for (int g = 0; g < G; ++g) {
      const __m256 mv = load8(w, w.m, (grp * G + g) * RG);
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

#if defined(__x86_64__)
// store_tokens for row groups grp and grp + 1 at once (16 lanes: each lane's min-term chain and final add are the
// 8-lane form's, so the same bits), from their sums lo, hi [T, 8]
template <int TN>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,f16c")))
void store_pair_tokens(const W& w, const Act& act, int64_t grp, int t0, const float* lo, const float* hi, float* y) {
  const int G = w.G;
  __m512 mt[TN];
  for (int t = 0; t < TN; ++t) mt[t] = _mm512_setzero_ps();
  if (w.m) {
    for (int g = 0; g < G; ++g) {
      const __m512 mv = load16(w, w.m, (grp * G + g) * RG, int64_t(G) * RG);
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
#endif

// Tokens t0 .. t0 + TT - 1 of one row group over blocks ga .. gb - 1, continuing the fp32 sums in accp [TT, 8].
template <int TT>
__attribute__((target("avx2,fma,f16c")))
void group_avx2(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  LEAPLM_GROUP_BODY(block_dot_avx2)
}

template <int TT>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
void group_vnni(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  LEAPLM_GROUP_BODY(block_dot_vnni)
}

template <int TT>
__attribute__((target("avx2,fma,f16c")))
void group_avx2_half(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  LEAPLM_GROUP_BODY_HALF(block_dot2_avx2)
}

template <int TT>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
void group_vnni_half(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* accp) {
  LEAPLM_GROUP_BODY_HALF(block_dot2_vnni)
}

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

// Blocks of 32 per pass over the tokens: the int8 activations one pass reads (T x blocks x 32 bytes) stay within
// about half of a 32 KiB L1 data cache beside the group's weights, so a block's weights are read from L1 by every
// token tile and no tile evicts the next one's activations.
constexpr int ACT_L1_BYTES = 16384;
constexpr int PAIR_TMAX = 8;      // tokens per tile of a pair of groups (16 measured the same on SmolLM2's shapes)

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
    const __m512 sv = load16(w, w.s, (grp * G + g) * RG, int64_t(G) * RG);
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

template <int TT>
inline void pair_tile(const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* lo, float* hi) {
  if (w.int4) pair_vnni<TT, true>(w, act, grp, t0, ga, gb, lo, hi);
  else pair_vnni<TT, false>(w, act, grp, t0, ga, gb, lo, hi);
}

template <int TT>
inline void pair_tail(int rem, const W& w, const Act& act, int64_t grp, int t0, int ga, int gb, float* lo, float* hi) {
  if constexpr (TT >= 1) {
    if (rem == TT) pair_tile<TT>(w, act, grp, t0, ga, gb, lo, hi);
    else pair_tail<TT - 1>(rem, w, act, grp, t0, ga, gb, lo, hi);
  }
}

// Row groups grp and grp + 1 (int8 and int4 formats) as group_simd<true> computes each.
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

// ---- AMX (Intel's tile matrix unit) ---------------------------------------------------------------------------
// Two row groups (16 rows) and up to 16 tokens per tile product: C [tokens, 16 rows] int32 = A [tokens, 32] int8
// (the activations of block g, block-major) x B (the 16 rows' 32 weights of block g in 8 rows of 16 x 4 bytes).
// One tdpbssd / tdpbsud is the whole block's P[g] for every (token, row) pair, exact int32, so the fp32 part that
// follows is pair_vnni's, in the same order (fma(float(P), s * a, acc) block by block): the same bits.

// ldtilecfg's 64-byte operand: tiles 0/3 A [tt, 32 bytes], 1/4 B [8, 64 bytes], 2/5 C [tt, 64 bytes] (two sets,
// so that block g + 1's product runs while block g's fp32 part does)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile loads, stores and configuration in asm of our own: gcc 12's intrinsics tell the compiler neither that
// tileloadd reads the bytes just stored to a buffer nor that tilestored writes one (nor that ldtilecfg reads all
// 64 bytes of its operand), so it may drop or move those stores and loads.
#define LEAPLM_TILE_LOAD(t, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(int64_t(stride)) : "memory")
#define LEAPLM_TILE_STORE(t, base, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(int64_t(stride)) : "memory")

__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& c) {
  asm volatile("ldtilecfg %0" ::"m"(c));
}

// The tiles of one thread for the span of a region of work, configured for one token count at a time: the
// thread's configuration as it was found (libllama's AMX code, for one, configures a thread's tiles once and
// expects to find them so) is saved first and restored at the end, or the tiles released if none was loaded.
class TileScope {
 public:
  __attribute__((target("amx-tile"))) TileScope() { asm volatile("sttilecfg %0" : "=m"(saved_)); }
  __attribute__((target("amx-tile"))) ~TileScope() {
    if (saved_.palette != 0) load_tile_config(saved_);
    else _tile_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

  // tiles 0/3 A [tt, 32 bytes], 1/4 B [8, 64 bytes], 2/5 C [tt, 64 bytes]
  __attribute__((target("amx-tile"))) void use(int tt) {
    if (tt_ == tt) return;
    TileConfig c;
    for (int s = 0; s < 2; ++s) {
      c.rows[3 * s] = uint8_t(tt), c.colsb[3 * s] = QK;
      c.rows[3 * s + 1] = 8, c.colsb[3 * s + 1] = 64;
      c.rows[3 * s + 2] = uint8_t(tt), c.colsb[3 * s + 2] = 64;
    }
    load_tile_config(c);
    tt_ = tt;
  }

  // every tile [16, 64 bytes] (int8_peak)
  __attribute__((target("amx-tile"))) void use_square() {
    TileConfig c;
    for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
    load_tile_config(c);
    tt_ = -1;
  }

 private:
  TileConfig saved_;
  int tt_ = 0;
};

// B for block g of row groups grp and grp + 1 in tile rows of 64 bytes: row c = chunk c (elements 4c .. 4c+3) of
// the 8 rows of grp, then of grp + 1; int4 nibbles unpacked to bytes 0..15, int8 bytes as stored (signed)
template <bool INT4>
__attribute__((target("avx2,avx512f,avx512bw,avx512dq,avx512vl,f16c")))
LEAPLM_INLINE void tile_rows(const uint8_t* lo, const uint8_t* hi, uint8_t* b) {
  __m512i u[8];
  load_pair<INT4>(lo, hi, u);
  for (int c = 0; c < 8; ++c) _mm512_store_si512(b + 64 * c, u[c]);
}

// acc[t] (16 rows of token t0 + t) += float(C[t]) * (s * a[t]) for one block, C as tdp*d stored it
template <int TT>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,f16c")))
LEAPLM_INLINE void tile_fma(__m512* acc, const int32_t* c, const __m512 sv, const float* ag) {
  for (int t = 0; t < TT; ++t)
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * t)), _mm512_mul_ps(sv, _mm512_set1_ps(ag[t])),
                             acc[t]);
}

// The tile product of one block: B's rows (unpacked before, in b) with A's tokens, C stored to c; tile set S
// (0: tiles 0-2, 1: tiles 3-5), so that two blocks' products are in flight at once
template <bool INT4, int S>
__attribute__((target("amx-tile,amx-int8")))
LEAPLM_INLINE void tile_product(const uint8_t* b, const int8_t* a, int32_t* c) {
  if constexpr (S == 0) {
    LEAPLM_TILE_LOAD(1, b, 64);
    LEAPLM_TILE_LOAD(0, a, QK);
    _tile_zero(2);
    if constexpr (INT4) _tile_dpbsud(2, 0, 1);
    else _tile_dpbssd(2, 0, 1);
    LEAPLM_TILE_STORE(2, c, 64);
  } else {
    LEAPLM_TILE_LOAD(4, b, 64);
    LEAPLM_TILE_LOAD(3, a, QK);
    _tile_zero(5);
    if constexpr (INT4) _tile_dpbsud(5, 3, 4);
    else _tile_dpbssd(5, 3, 4);
    LEAPLM_TILE_STORE(5, c, 64);
  }
}

constexpr int AMX_CHUNK = 2;     // blocks per stage of pair_amx's pipeline

// Tokens t0 .. t0 + TT - 1 of row groups grp and grp + 1 over every block, in chunks of AMX_CHUNK blocks and
// three stages a chunk apart: chunk c + 1's weights are unpacked to bytes, chunk c's tile products run, chunk
// c - 1's fp32 part reads their results. A tile load reads bytes stored a stage earlier and the fp32 part reads
// tiles stored a stage earlier, so neither waits on a store just issued (a tile load is not fed from pending
// stores; it waits until they are written); the fp32 part still runs block by block in order.
template <int TT, bool INT4>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,amx-tile,amx-int8,f16c")))
void pair_amx(const W& w, const Act& act, int64_t grp, int t0, float* acc_lo, float* acc_hi, TileScope& tiles) {
  const int G = w.G, T = act.T;
  tiles.use(TT);
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) uint8_t bbuf[2][AMX_CHUNK][8 * 64];                       // chunk c's B rows in bbuf[c % 2]
  alignas(64) int32_t cbuf[2][AMX_CHUNK][16 * 16];                      // chunk c's C tiles in cbuf[c % 2]
  const int64_t bb = w.block_bytes(), next = int64_t(G) * bb, sn = int64_t(G) * RG;
  const int8_t* qa = act.qab.data() + int64_t(t0) * QK;               // block g's tokens at qa + g * T * 32
  const uint8_t* wq = w.q + grp * G * bb;                               // block g of grp at wq + g * bb
  const float* ab = act.ab.data() + t0;                                 // block g's token scales at ab + g * T
  const int chunks = (G + AMX_CHUNK - 1) / AMX_CHUNK;
  auto blocks_in = [G](int c) { return std::min(AMX_CHUNK, G - c * AMX_CHUNK); };
  for (int c = -1; c <= chunks; ++c) {
    if (c + 1 < chunks) {
      const int g0 = (c + 1) * AMX_CHUNK, n = blocks_in(c + 1);
      for (int i = 0; i < n; ++i) {
        const int64_t g = grp * G + g0 + i;
        prefetch_ahead(w, g * bb, g * RG);
        prefetch_ahead(w, (g + G) * bb, (g + G) * RG);
        tile_rows<INT4>(wq + (g0 + i) * bb, wq + (g0 + i) * bb + next, bbuf[(c + 1) & 1][i]);
      }
    }
    if (c >= 0 && c < chunks) {
      const int g0 = c * AMX_CHUNK, n = blocks_in(c);
      for (int i = 0; i < n; i += 2) {
        tile_product<INT4, 0>(bbuf[c & 1][i], qa + int64_t(g0 + i) * T * QK, cbuf[c & 1][i]);
        if (i + 1 < n) tile_product<INT4, 1>(bbuf[c & 1][i + 1], qa + int64_t(g0 + i + 1) * T * QK, cbuf[c & 1][i + 1]);
      }
    }
    if (c >= 1) {
      const int g0 = (c - 1) * AMX_CHUNK, n = blocks_in(c - 1);
      for (int i = 0; i < n; ++i) {
        const int g = g0 + i;
        tile_fma<TT>(acc, cbuf[(c - 1) & 1][i], load16(w, w.s, (grp * G + g) * RG, sn), ab + int64_t(g) * T);
      }
    }
  }
  for (int t = 0; t < TT; ++t) {
    _mm256_store_ps(acc_lo + 8 * t, _mm512_castps512_ps256(acc[t]));
    _mm256_store_ps(acc_hi + 8 * t, _mm512_extractf32x8_ps(acc[t], 1));
  }
}

template <int TT>
inline void amx_tail(int rem, const W& w, const Act& act, int64_t grp, int t0, float* lo, float* hi, TileScope& tiles) {
  if constexpr (TT >= 1) {
    if (rem != TT) return amx_tail<TT - 1>(rem, w, act, grp, t0, lo, hi, tiles);
    if (w.int4) pair_amx<TT, true>(w, act, grp, t0, lo, hi, tiles);
    else pair_amx<TT, false>(w, act, grp, t0, lo, hi, tiles);
  }
}

// Row groups grp and grp + 1 (int8 and int4 formats) on AMX, in token tiles of 16: the bits of pair_simd
void pair_amx_simd(const W& w, const Act& act, int64_t grp, float* y, TileScope& tiles) {
  alignas(64) float lo[MAX_T * 8], hi[MAX_T * 8];
  for (int t = 0; t < act.T; t += 16)
    amx_tail<16>(std::min(16, act.T - t), w, act, grp, t, lo + 8 * t, hi + 8 * t, tiles);
  store_pair(w, act, grp, lo, hi, y);
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
    if (path >= AVX512VNNI && !w.half && act.T >= PAIR_MIN_T && grp + 1 < g1) { pair_simd(w, act, grp++, y); continue; }
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

// x [T, K] fp32 contiguous (T <= 32); qp, sp, mp packed as above; returns y [T, N].
torch::Tensor qlinear(torch::Tensor x, torch::Tensor qp, torch::Tensor sp, c10::optional<torch::Tensor> mp,
                      c10::optional<torch::Tensor> bias, int64_t N, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [T, K] contiguous fp32");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(T >= 1 && T <= MAX_T, "qlinear takes 1..", MAX_T, " tokens, got ", T);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  const bool int4 = mp.has_value();
  const int64_t G = K / QK, NG = (N + RG - 1) / RG;
  TORCH_CHECK(qp.is_contiguous() && qp.scalar_type() == torch::kUInt8 && qp.numel() == NG * G * (int4 ? 128 : 256),
              "qp: packed uint8 [N/8, G, ", int4 ? 128 : 256, "]");
  const bool half = !int4 && sp.numel() == 2 * NG * G * RG;        // int6: a scale per half block
  const bool s16 = sp.scalar_type() == torch::kHalf;
  TORCH_CHECK(sp.is_contiguous() && (sp.scalar_type() == torch::kFloat || (s16 && !half)) &&
                  (half || sp.numel() == NG * G * RG),
              "sp: fp32 or fp16 [N/8, G, 8] (int6: fp32 [N/8, G, 2, 8])");
  if (int4)
    TORCH_CHECK(mp->is_contiguous() && mp->scalar_type() == sp.scalar_type() && mp->numel() == NG * G * RG,
                "mp: [N/8, G, 8] in sp's type");
  TORCH_CHECK(path >= SCALAR && path <= AMX, "path: 0 scalar, 1 AVX2, 2 AVX-512 VNNI, 3 AMX");
  TORCH_CHECK(path != AMX || amx_permitted(), "path 3 (AMX): the operating system does not grant the tile registers");
#if !defined(__x86_64__)
  path = SCALAR;
#endif
  Span span(R_QLINEAR);
  Act act;
  quantize_act(x.data_ptr<float>(), int(T), K, act, int(path));
  const W w{qp.data_ptr<uint8_t>(), sp.data_ptr(), int4 ? mp->data_ptr() : nullptr, N, int(G), int4, half, N, s16};
  auto y = torch::empty({T, N}, x.options());
  float* yp = y.data_ptr<float>();
  leaplm_pool::parallel_for(NG, group_grain(NG),
                            [&](int64_t g0, int64_t g1) { run_groups(w, act, int(path), g0, g1, yp); });
  if (bias.has_value()) y.add_(*bias);
  return y;
}

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

// The region timers' sums (LEAPLM_KERNEL_PROFILE=1): {region: (milliseconds, calls)}; empty when profiling is off.
std::map<std::string, std::pair<double, int64_t>> profile() {
  std::map<std::string, std::pair<double, int64_t>> out;
  Profile& p = profile_state();
  if (!p.on) return out;
  for (int r = 0; r < R_COUNT; ++r) out[REGION_NAMES[r]] = {p.ns[r].load() * 1e-6, p.calls[r].load()};
  return out;
}

void profile_reset() {
  Profile& p = profile_state();
  for (int r = 0; r < R_COUNT; ++r) p.ns[r].store(0), p.calls[r].store(0);
}


// ---- the decoder's layer loop -----------------------------------------------------------------------------------
// A Llama-family decoder layer stack over packed quantized weights in one C++ call: RMSNorm, q/k/v, rope, the KV
// cache write, attention, the output projection, RMSNorm, gate/up, SiLU, down, the residuals. Every token is
// computed on its own (norms per token, linears row-independent as above, attention per query over its allowed
// keys in key order), so a token's result does not depend on T, on the other rows of a batch, or on the thread
// split. The element-wise code is compiled for the baseline instruction set (the reference, which the scalar path
// runs) and, where a SIMD path runs, in AVX2 (exp, attention: written out in 8-lane intrinsics; norms, SiLU's
// arithmetic: the same C++ compiled for AVX2 without FMA contraction), the same operations per element in the
// same order, so the same bits.

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

// silu(gate) * up per row, gate = gu[:, :inter], up = gu[:, inter:]; exp_ is exp_base or exp_avx2 (the same bits)
LEAPLM_INLINE void silu_mul_body(const float* gu, int64_t m0, int64_t m1, int64_t inter, float* out,
                                 void (*exp_)(float*, int64_t)) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* g = gu + m * 2 * inter;
    float* o = out + m * inter;
    for (int64_t i = 0; i < inter; ++i) o[i] = -g[i];
    exp_(o, inter);
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + o[i]) * g[inter + i];
  }
}

void add_norm_base(float* x, const float* d, const float* w, int64_t m0, int64_t m1, int64_t n, float eps, float* y) {
  add_norm_body(x, d, w, m0, m1, n, eps, y);
}
void silu_mul_base(const float* gu, int64_t m0, int64_t m1, int64_t inter, float* out) {
  silu_mul_body(gu, m0, m1, inter, out, exp_base);
}
#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) void add_norm_avx2(float* x, const float* d, const float* w, int64_t m0, int64_t m1,
                                                   int64_t n, float eps, float* y) {
  add_norm_body(x, d, w, m0, m1, n, eps, y);
}
__attribute__((target("avx2,f16c"))) void silu_mul_avx2(const float* gu, int64_t m0, int64_t m1, int64_t inter, float* out) {
  silu_mul_body(gu, m0, m1, inter, out, exp_avx2);
}
#else
void add_norm_avx2(float* x, const float* d, const float* w, int64_t m0, int64_t m1, int64_t n, float eps, float* y) {
  add_norm_body(x, d, w, m0, m1, n, eps, y);
}
void silu_mul_avx2(const float* gu, int64_t m0, int64_t m1, int64_t inter, float* out) {
  silu_mul_body(gu, m0, m1, inter, out, exp_base);
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

struct PackedPart {
  torch::Tensor q, s, m;         // m: empty when absent
  int64_t rows;
  W view(int64_t K, int64_t ldy) const {
    const bool int4 = m.numel() > 0;
    return W{q.data_ptr<uint8_t>(), s.data_ptr(), int4 ? m.data_ptr() : nullptr, rows, int(K / QK),
             int4, !int4 && s.numel() == 2 * ((rows + RG - 1) / RG) * (K / QK) * RG, ldy,
             s.scalar_type() == torch::kHalf};
  }
};

// one linear: its row blocks (one, or several in different formats), output rows side by side
struct PackedLinear {
  std::vector<PackedPart> parts;
  torch::Tensor bias;            // empty when absent
  int64_t rows;
  std::vector<W> view(int64_t K) const {
    std::vector<W> out;
    for (const auto& p : parts) out.push_back(p.view(K, rows));
    return out;
  }
  const float* b() const { return bias.numel() ? bias.data_ptr<float>() : nullptr; }
};

// run_layers' buffers (Decoder::run_layers)
struct LayerScratch {
  std::vector<float> h, qkv, att, tmp, gu, act;
  std::vector<int64_t> keys, nkeys;
};

// v with at least n elements (grown when short; its contents are the caller's to write)
template <typename V>
V& grown(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v;
}

struct Layer {
  torch::Tensor ln1, ln2;
  PackedLinear qkv, o, gate_up, down;      // packed quantized weights (add_layer)
  DenseLinear dqkv, dout, dgate_up, ddown; // or dense ones, fp32 or bf16 (add_dense_layer)
  bool dense = false;
};

class Decoder {
 public:
  Decoder(int64_t H, int64_t Hkv, int64_t D, int64_t hid, int64_t inter, double eps, int64_t path)
      : H(H), Hkv(Hkv), D(D), hid(hid), inter(inter), eps(float(eps)), path(int(path)) {
    TORCH_CHECK(path != AMX || amx_permitted(), "path 3 (AMX): the operating system does not grant the tile registers");
    TORCH_CHECK(D % 8 == 0 && hid % 8 == 0 && inter % 8 == 0 && H % Hkv == 0,
                "decoder: head_dim, hidden and intermediate sizes multiples of 8");
  }

  // linears in the order q/k/v, o, gate/up, down: each a list of row blocks (qp, sp, mp or empty, rows), and a
  // bias or empty
  void add_layer(torch::Tensor ln1, torch::Tensor ln2, std::vector<std::vector<torch::Tensor>> qp,
                 std::vector<std::vector<torch::Tensor>> sp, std::vector<std::vector<torch::Tensor>> mp,
                 std::vector<torch::Tensor> bias, std::vector<std::vector<int64_t>> rows) {
    TORCH_CHECK(qp.size() == 4 && sp.size() == 4 && mp.size() == 4 && bias.size() == 4 && rows.size() == 4,
                "add_layer: four linears");
    TORCH_CHECK(hid % QK == 0 && inter % QK == 0 && (H * D) % QK == 0,
                "add_layer: quantized linears need hidden and intermediate sizes multiples of 32");
    const int64_t want[4] = {(H + 2 * Hkv) * D, hid, 2 * inter, hid};
    PackedLinear p[4];
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(!qp[i].empty() && sp[i].size() == qp[i].size() && mp[i].size() == qp[i].size() &&
                  rows[i].size() == qp[i].size(), "add_layer: linear ", i, ": one (q, s, m, rows) per part");
      int64_t total = 0;
      for (size_t j = 0; j < qp[i].size(); ++j) {
        const auto st = sp[i][j].scalar_type();
        TORCH_CHECK((st == torch::kFloat || st == torch::kHalf) && (mp[i][j].numel() == 0 || mp[i][j].scalar_type() == st),
                    "add_layer: linear ", i, ": scales fp32 or fp16, minimums in the scales' type");
        p[i].parts.push_back(PackedPart{qp[i][j].contiguous(), sp[i][j].contiguous(), mp[i][j].contiguous(), rows[i][j]});
        total += rows[i][j];
      }
      TORCH_CHECK(total == want[i], "add_layer: linear ", i, " has ", total, " rows, expected ", want[i]);
      p[i].bias = bias[i].contiguous().to(torch::kFloat);
      p[i].rows = total;
    }
    layers.push_back(Layer{ln1.contiguous().to(torch::kFloat), ln2.contiguous().to(torch::kFloat), p[0], p[1], p[2], p[3]});
  }

  // a layer of dense weights (fp32, or bf16 where that holds them exactly): w = [q/k/v [(H + 2 Hkv) D, hid], o [hid, H D], gate/up [2 inter, hid],
  // down [hid, inter]], bias = one per linear, or empty
  void add_dense_layer(torch::Tensor ln1, torch::Tensor ln2, std::vector<torch::Tensor> w,
                       std::vector<torch::Tensor> bias) {
    TORCH_CHECK(w.size() == 4 && bias.size() == 4, "add_dense_layer: four linears");
    const int64_t want[4][2] = {{(H + 2 * Hkv) * D, hid}, {hid, H * D}, {2 * inter, hid}, {hid, inter}};
    DenseLinear d[4];
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(w[i].dim() == 2 && w[i].size(0) == want[i][0] && w[i].size(1) == want[i][1],
                  "add_dense_layer: linear ", i, ": [", want[i][0], ", ", want[i][1], "]");
      TORCH_CHECK(bias[i].numel() == 0 || bias[i].numel() == want[i][0], "add_dense_layer: bias ", i);
      d[i] = DenseLinear{dense_weight(w[i]), bias[i].contiguous().to(torch::kFloat)};
    }
    Layer L{ln1.contiguous().to(torch::kFloat), ln2.contiguous().to(torch::kFloat)};
    L.dqkv = d[0], L.dout = d[1], L.dgate_up = d[2], L.ddown = d[3];
    L.dense = true;
    layers.push_back(L);
  }

  // the embedding [V, hid] and the output layer [V', hid] (fp32 or bf16), the final norm [hid]: what logits()
  // adds around the layers
  void set_head(torch::Tensor embed_w, torch::Tensor norm_w, torch::Tensor head_w) {
    TORCH_CHECK(embed_w.dim() == 2 && embed_w.size(1) == hid && head_w.dim() == 2 && head_w.size(1) == hid &&
                norm_w.numel() == hid, "set_head: embedding [V, hidden], norm [hidden], output [V', hidden]");
    embed = dense_weight(embed_w);
    norm = norm_w.contiguous().to(torch::kFloat);
    head = DenseLinear{dense_weight(head_w), torch::Tensor()};
  }

  // The whole forward: ids [B * T] int64 (row b * T + t), the rest as forward(); every layer runs. Returns the
  // logits [B, T, V'] (last_only: [B, 1, V'], each row's last token).
  torch::Tensor logits(torch::Tensor ids, int64_t B, int64_t T, std::vector<torch::Tensor> cache_k,
                       std::vector<torch::Tensor> cache_v, std::vector<int64_t> lens, torch::Tensor pos,
                       torch::Tensor mask, torch::Tensor cis, int64_t kv_len, bool last_only) {
    TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.numel() == B * T, "ids: int64 [B * T]");
    auto idc = ids.contiguous();
    torch::Tensor out = torch::empty({B, last_only ? 1 : T, head.w.defined() ? head.w.size(0) : 0}, torch::kFloat);
    whole(idc.data_ptr<int64_t>(), B, T, cache_k, cache_v, lens, pos, mask, cis, kv_len, last_only,
          out.data_ptr<float>());
    return out;
  }

  // Greedy drafting of k tokens for one row in one call: feeds ids [T] after the row's `len` cached tokens, takes
  // the argmax of the last token's logits over the first `real` rows (the first on ties, as torch's argmax), feeds
  // it, and so on; the cache then holds the ids and the first k - 1 drafts. Returns the k drafts.
  std::vector<int64_t> greedy_chain(std::vector<int64_t> ids, int64_t k, std::vector<torch::Tensor> cache_k,
                                    std::vector<torch::Tensor> cache_v, int64_t len, torch::Tensor cis, int64_t real) {
    TORCH_CHECK(!ids.empty() && k >= 1, "greedy_chain: ids and k >= 1");
    const int64_t V = head.w.defined() ? head.w.size(0) : 0;
    real = std::min(real, V);
    TORCH_CHECK(real >= 1, "greedy_chain: no rows to choose from");
    std::vector<float> logit(V);
    std::vector<int64_t> out, feed = ids;
    const torch::Tensor none = torch::empty({0}, torch::kLong), nomask = torch::empty({0}, torch::kBool);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t T = int64_t(feed.size());
      whole(feed.data(), 1, T, cache_k, cache_v, {len}, none, nomask, cis, len + T, true, logit.data());
      int64_t best = 0;
      for (int64_t v = 1; v < real; ++v)
        if (logit[v] > logit[best]) best = v;
      out.push_back(best);
      len += T;
      feed.assign(1, best);
    }
    return out;
  }

  // x [B * T, hid] fp32 (row b * T + t); cache_k / cache_v per layer [B', Hkv, capacity, D] fp32 (B' >= B);
  // lens [B] cached tokens per row; pos [B, T] int64 positions; mask: empty (causal) or bool [B, T, S]; cis
  // [P, D / 2, 2] fp32 (cos, sin); run: the layers to run, in order; kv_len = the keys attended (S).
  torch::Tensor forward(torch::Tensor x, int64_t B, int64_t T, std::vector<torch::Tensor> cache_k,
                        std::vector<torch::Tensor> cache_v, std::vector<int64_t> lens, torch::Tensor pos,
                        torch::Tensor mask, torch::Tensor cis, std::vector<int64_t> run, int64_t kv_len) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) == B * T && x.size(1) == hid && x.scalar_type() == torch::kFloat,
                "x: fp32 [B * T, hidden]");
    torch::Tensor out = x.clone();
    run_layers(out.data_ptr<float>(), B, T, cache_k, cache_v, lens, pos, mask, cis, run, kv_len);
    return out;
  }

  // the layers `run` over the residual stream xp [B * T, hid], in place (see forward)
  void run_layers(float* xp, int64_t B, int64_t T, std::vector<torch::Tensor>& cache_k,
                  std::vector<torch::Tensor>& cache_v, const std::vector<int64_t>& lens, const torch::Tensor& pos,
                  const torch::Tensor& mask, const torch::Tensor& cis, const std::vector<int64_t>& run,
                  int64_t kv_len) {
    TORCH_CHECK(int64_t(lens.size()) >= B && pos.scalar_type() == torch::kLong &&
                (pos.numel() == B * T || pos.numel() == 0), "lens, pos");
    TORCH_CHECK(cis.scalar_type() == torch::kFloat && cis.dim() == 3 && cis.size(1) * 2 == D, "cis: [P, D/2, 2]");
    TORCH_CHECK(mask.numel() == 0 || (mask.scalar_type() == torch::kBool && mask.numel() == B * T * kv_len),
                "mask: bool [B, T, S]");
    TORCH_CHECK(cache_k.size() >= layers.size() && cache_v.size() >= layers.size(), "cache: one tensor per layer");
    const int64_t M = B * T;
    // no positions given: row b's token t sits at lens[b] + t
    std::vector<int64_t> own;
    if (pos.numel() == 0) {
      own.resize(M);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) own[b * T + t] = lens[b] + t;
    }
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(lens[b] + T <= cis.size(0), "position ", lens[b] + T - 1, " beyond the rope table's ", cis.size(0));
    auto posc = pos.contiguous();
    const int64_t* posp = pos.numel() ? posc.data_ptr<int64_t>() : own.data();
    auto maskc = mask.contiguous();
    auto cisc = cis.contiguous();
    // the calling thread's buffers, kept between forwards and grown, never shrunk: allocated and zeroed per
    // forward, the larger ones come from fresh pages each time (a forward over 16 or 32 tokens), and the next
    // small forward runs slower after them
    static thread_local LayerScratch scratch;
    auto& h = grown(scratch.h, M * hid);
    auto& qkv = grown(scratch.qkv, M * (H + 2 * Hkv) * D);
    auto& att = grown(scratch.att, M * H * D);
    auto& tmp = grown(scratch.tmp, M * hid);
    auto& gu = grown(scratch.gu, M * 2 * inter);
    auto& act = grown(scratch.act, M * inter);
    // the key slots each query attends, in key order (the same in every layer)
    auto& keys = grown(scratch.keys, M * kv_len);
    auto& nkeys = grown(scratch.nkeys, M);
    const bool* mp = maskc.numel() ? maskc.data_ptr<bool>() : nullptr;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t bt = b * T + t;
        int64_t n = 0;
        for (int64_t j = 0; j < kv_len; ++j)
          if (mp ? mp[bt * kv_len + j] : j <= lens[b] + t) keys[bt * kv_len + n++] = j;
        nkeys[bt] = n;
      }
    const float* pending = nullptr;          // the down projection not yet added to the residual stream
    for (int64_t li : run) {
      TORCH_CHECK(li >= 0 && li < int64_t(layers.size()), "layer ", li, " out of range");
      const Layer& L = layers[li];
      auto& ck = cache_k[li];
      auto& cv = cache_v[li];
      TORCH_CHECK(ck.is_contiguous() && cv.is_contiguous() && ck.scalar_type() == torch::kFloat &&
                  ck.size(0) >= B && ck.size(1) == Hkv && ck.size(3) == D && ck.size(2) >= kv_len,
                  "cache: contiguous fp32 [B, Hkv, capacity, D]");
      add_norm(xp, pending, L.ln1.data_ptr<float>(), M, h.data());         // the previous layer's residual
      {
        Span span(R_QKV);
        linear(L.qkv, L.dqkv, L.dense, h.data(), M, hid, qkv.data());
      }
      {
        Span span(R_ROPE);
        rope_and_store(qkv.data(), B, T, posp, cisc.data_ptr<float>(), lens, ck, cv);
      }
      {
        Span span(R_ATTN);
        attention(qkv.data(), B, T, keys.data(), nkeys.data(), ck, cv, kv_len, att.data());
      }
      {
        Span span(R_O);
        linear(L.o, L.dout, L.dense, att.data(), M, H * D, tmp.data());
      }
      add_norm(xp, tmp.data(), L.ln2.data_ptr<float>(), M, h.data());
      {
        Span span(R_GATE_UP);
        linear(L.gate_up, L.dgate_up, L.dense, h.data(), M, hid, gu.data());
      }
      {
        Span span(R_SILU);
        over_rows(M, 8, [&](int64_t m0, int64_t m1) {
          (path > 0 ? silu_mul_avx2 : silu_mul_base)(gu.data(), m0, m1, inter, act.data());
        });
      }
      {
        Span span(R_DOWN);
        linear(L.down, L.ddown, L.dense, act.data(), M, inter, tmp.data());
      }
      pending = tmp.data();
    }
    if (pending) {
      Span span(R_RESID);
      for (int64_t i = 0; i < M * hid; ++i) xp[i] += pending[i];
    }
  }

  int64_t num_layers() const { return int64_t(layers.size()); }

 private:
  int64_t H, Hkv, D, hid, inter;
  float eps;
  int path;
  std::vector<Layer> layers;
  torch::Tensor embed, norm;               // set_head's (logits() only)
  DenseLinear head;

  // embedding, layers, final norm and output layer (logits' body): the logits into out [R, V'] (R = B with
  // last_only, else B * T)
  void whole(const int64_t* id, int64_t B, int64_t T, std::vector<torch::Tensor>& cache_k,
             std::vector<torch::Tensor>& cache_v, const std::vector<int64_t>& lens, const torch::Tensor& pos,
             const torch::Tensor& mask, const torch::Tensor& cis, int64_t kv_len, bool last_only, float* out) {
    TORCH_CHECK(embed.defined() && head.w.defined(), "logits: set_head first");
    const int64_t M = B * T, V = embed.size(0);
    for (int64_t m = 0; m < M; ++m) TORCH_CHECK(id[m] >= 0 && id[m] < V, "token id ", id[m], " out of range");
    std::vector<float> x(M * hid);
    float* xp = x.data();
    if (embed.scalar_type() == torch::kBFloat16) {
      const uint16_t* ep = reinterpret_cast<const uint16_t*>(embed.data_ptr());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < hid; ++i) xp[m * hid + i] = widen(ep[id[m] * hid + i]);
    } else {
      const float* ep = embed.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) std::memcpy(xp + m * hid, ep + id[m] * hid, sizeof(float) * hid);
    }
    std::vector<int64_t> run(layers.size());
    for (size_t i = 0; i < run.size(); ++i) run[i] = int64_t(i);
    run_layers(xp, B, T, cache_k, cache_v, lens, pos, mask, cis, run, kv_len);
    const int64_t R = last_only ? B : M;
    std::vector<float> h(R * hid);
    if (last_only && T > 1)
      for (int64_t b = 0; b < B; ++b) std::memcpy(xp + b * hid, xp + (b * T + T - 1) * hid, sizeof(float) * hid);
    add_norm(xp, nullptr, norm.data_ptr<float>(), R, h.data());
    head.run(h.data(), R, path, out);
  }

  void linear(const PackedLinear& p, const DenseLinear& d, bool dense, const float* x, int64_t M, int64_t K,
              float* y) {
    if (dense) d.run(x, M, path, y);
    else linear_raw(x, M, K, p.view(K), p.b(), path, y);
  }

  // rotate each q and k head's pairs (2i, 2i+1) by the position's (cos, sin); write k and v to the cache slots
  void rope_and_store(float* qkv, int64_t B, int64_t T, const int64_t* pos, const float* cis,
                      const std::vector<int64_t>& lens, torch::Tensor& ck, torch::Tensor& cv) {
    const int64_t width = (H + 2 * Hkv) * D, cap = ck.size(2);
    float* kp = ck.data_ptr<float>();
    float* vp = cv.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        float* row = qkv + (b * T + t) * width;
        const float* c = cis + pos[b * T + t] * D;
        for (int64_t hh = 0; hh < H + Hkv; ++hh) {
          float* v = row + hh * D;
          for (int64_t i = 0; i < D / 2; ++i) {
            const float a = v[2 * i], bb = v[2 * i + 1], co = c[2 * i], si = c[2 * i + 1];
            v[2 * i] = a * co - bb * si;
            v[2 * i + 1] = a * si + bb * co;
          }
        }
        const int64_t slot = lens[b] + t;
        for (int64_t g = 0; g < Hkv; ++g) {
          std::memcpy(kp + ((b * Hkv + g) * cap + slot) * D, row + (H + g) * D, sizeof(float) * D);
          std::memcpy(vp + ((b * Hkv + g) * cap + slot) * D, row + (H + Hkv + g) * D, sizeof(float) * D);
        }
      }
  }

  // softmax(q k^T / sqrt(D)) v per (row, head, query) over the allowed keys in key order
  void attention(const float* qkv, int64_t B, int64_t T, const int64_t* keys, const int64_t* nkeys,
                 const torch::Tensor& ck, const torch::Tensor& cv, int64_t S, float* out) {
    const int64_t width = (H + 2 * Hkv) * D, cap = ck.size(2), rep = H / Hkv;
    const float* kp = ck.data_ptr<float>();
    const float* vp = cv.data_ptr<float>();
    const float scale = 1.f / std::sqrt(float(D));
    const bool wide = path > 0;
    const int64_t work = B * H * T * S * D;
    // one item per (row, head, query): the queries of a block spread evenly over the threads
    const int64_t items = B * H * T;
    const int64_t grain = work > (1 << 18) ? std::max<int64_t>(1, items / (8 * int64_t(at::get_num_threads()))) : items;
    leaplm_pool::parallel_for(items, grain, [&](int64_t i0, int64_t i1) {
      static thread_local std::vector<float> scores;           // a query's softmax over its keys
      std::vector<float>& p = grown(scores, S);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / (H * T), hh = (i / T) % H, t = i % T, g = hh / rep;
        const float* kb = kp + (b * Hkv + g) * cap * D;
        const float* vb = vp + (b * Hkv + g) * cap * D;
        const float* q = qkv + (b * T + t) * width + hh * D;
        const int64_t* ks = keys + (b * T + t) * S;
        float* dst = out + (b * T + t) * H * D + hh * D;
        if (wide) attend_avx2(q, kb, vb, ks, nkeys[b * T + t], D, scale, p.data(), dst);
        else attend_base(q, kb, vb, ks, nkeys[b * T + t], D, scale, p.data(), dst);
      }
    });
  }

  // x += d (d may be null), then h = rms_norm(x) * w, per row
  void add_norm(float* x, const float* d, const float* w, int64_t M, float* h) {
    Span span(R_NORM);
    if (path > 0) add_norm_avx2(x, d, w, 0, M, hid, eps, h);
    else add_norm_base(x, d, w, 0, M, hid, eps, h);
  }
};

}  // namespace

// Every entry point that computes runs without the GIL (the arguments are converted and the result wrapped while
// it is held): a forward is milliseconds of C++ during which the server's event loop thread must be able to run.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("qlinear", &qlinear, "int8-activation quantized linear for 1..32 tokens over packed weights",
        pybind11::arg("x"), pybind11::arg("qp"), pybind11::arg("sp"), pybind11::arg("mp"), pybind11::arg("bias"),
        pybind11::arg("n"), pybind11::arg("path"), nogil());
  m.def("int8_peak", &int8_peak, "int8 multiply-adds per second of a path's dot-product instruction, all threads",
        pybind11::arg("path"), pybind11::arg("iters"), nogil());
  m.def("pool_probe", &pool_probe, "the kernel's thread pool over n busy items (for tests): (thread per item, runs)",
        pybind11::arg("n"), pybind11::arg("grain"), pybind11::arg("us"), pybind11::arg("throw_at") = -1, nogil());
  m.def("quantize_activations", &quantize_activations, "per-token, per-32-block int8 activations (qa, a)",
        pybind11::arg("x"), pybind11::arg("path") = 0, nogil());
  m.def("set_amx_tokens", [](bool int4, std::vector<int64_t> tokens) {
          uint64_t mask = 0;
          for (int64_t t : tokens) {
            TORCH_CHECK(t >= 1 && t <= MAX_T, "set_amx_tokens: block sizes 1..", MAX_T, ", got ", t);
            mask |= 1ull << t;
          }
          AMX_TOKENS[int4] = mask;
        },
        "the block sizes whose linears the AMX path runs as tile products, for int4 or int8 weights (the bits do "
        "not depend on it)", pybind11::arg("int4"), pybind11::arg("tokens"));
  m.def("amx_tokens", [](bool int4) {
          std::vector<int64_t> out;
          for (int t = 1; t <= MAX_T; ++t) if (amx_for(int4, t)) out.push_back(t);
          return out;
        }, pybind11::arg("int4"));
  m.def("profile", &profile, "the region timers' sums {region: (ms, calls)} (LEAPLM_KERNEL_PROFILE=1), else {}");
  m.def("profile_reset", &profile_reset, "clear the region timers");
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t>())
      .def("add_layer", &Decoder::add_layer)
      .def("add_dense_layer", &Decoder::add_dense_layer)
      .def("set_head", &Decoder::set_head)
      .def("forward", &Decoder::forward, nogil())
      .def("logits", &Decoder::logits, nogil())
      .def("greedy_chain", &Decoder::greedy_chain, nogil())
      .def("num_layers", &Decoder::num_layers);
}

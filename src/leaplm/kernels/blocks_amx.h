// Block products on AMX (Intel's tile matrix unit), for pairs of row groups and up to 16 tokens a tile product:
//   A [tokens, 32 bytes]   block g's int8 activations, block-major (activations.h qab [G, T, 32]: rows of 32)
//   B [8 rows, 64 bytes]   block g of row groups grp and grp + 1: row c = chunk c (elements 4c .. 4c+3) of grp's
//                          8 rows then of grp + 1's (int4 nibbles unpacked to bytes 0..15), built by tile_rows
//   C [tokens, 64 bytes]   16 int32 per token: P[g] of the 16 rows, stored for pair_vnni's fp32 part
// Tiles 0-2 and 3-5 are two (A, B, C) sets, so that two blocks' products are in flight; the thread's own tile
// configuration is saved and restored around the kernel's use (TileScope).
#pragma once

#include "activations.h"
#include "blocks_vnni.h"
#include "common.h"

#if defined(__x86_64__)
namespace {

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
        tile_fma<TT>(acc, cbuf[(c - 1) & 1][i], load_scale16(w, (grp * G + g) * RG, sn), ab + int64_t(g) * T);
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

}  // namespace
#endif

// Block products, scalar reference: reads a packed weight (common.h: qp [N/8, G, chunks, 8 rows, 4 bytes] or int6's, sp/mp
// [N/8, G, 8] or int6 sp [N/8, G, 2, 8]) one element at a time through weight_at, and the token-major activations
// (activations.h: qa [T, K], a/sa [T, G]). The arithmetic every SIMD path reproduces bit for bit.
#pragma once

#include "activations.h"
#include "common.h"

namespace {

// ---- scalar reference ------------------------------------------------------------------------------------------
inline int weight_at(const W& w, int64_t grp, int g, int r, int j) {   // q[8 grp + r, g, j]
  const uint8_t* b = w.q + (grp * w.G + g) * w.block_bytes();
  if (!w.int4 && !w.half) return int(int8_t(b[((j / 4) * RG + r) * 4 + j % 4]));
  const int e = j % 16;
  const uint8_t byte = b[((e / 4) * RG + r) * 4 + e % 4];
  const int low = j < 16 ? (byte & 0x0F) : (byte >> 4);
  if (w.int4) return low;
  const int c = j / 4;                                   // int6: chunk c's top 2 bits in vector c / 4 at 2 (c % 4)
  const int top = (b[128 + ((c / 4) * RG + r) * 4 + j % 4] >> (2 * (c % 4))) & 3;
  return (low | (top << 4)) - 32;
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
          acc = std::fma(float(p[0]), scale_of(w, sh) * act.a[t * G + g], acc);
          acc = std::fma(float(p[1]), scale_of(w, sh + RG) * act.a[t * G + g], acc);
          continue;
        }
        int32_t p = 0;
        for (int j = 0; j < QK; ++j) p += weight_at(w, grp, g, r, j) * int32_t(qa[j]);
        acc = std::fma(float(p), scale_of(w, sg) * act.a[t * G + g], acc);
        if (w.int4) mt = std::fma(min_at(w, sg), act.sa[t * G + g], mt);
      }
      y[t * w.ldy + n] = acc + mt;
    }
  }
}

}  // namespace

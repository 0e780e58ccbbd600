// The decoder's layer loop (Decoder): reads the residual stream x [B * T, hid] fp32, per layer packed quantized
// linears (common.h; a linear may be several row blocks in different formats, rows side by side) or dense ones
// (dense.h), the KV cache per layer [B', Hkv, capacity, D] fp32, positions [B, T], a mask [B, T, S] and the rope
// tables cis [P, D / 2, 2], or [R, P, D / 2, 2] for R tables a layer picks from (cos, sin per position and rotated
// pair (2i, 2i + 1) of a head). A row of q/k/v is [H q heads | Hkv k heads | Hkv v heads] of D each.
#pragma once

#include <string>
#include <vector>

#include "common.h"
#include "dense.h"
#include "driver.h"
#include "layer_math.h"
#include "pool.h"
#include "timers.h"

// A Llama-family decoder layer stack over packed quantized weights in one C++ call: RMSNorm, q/k/v, rope, the KV
// cache write, attention, the output projection, RMSNorm, gate/up, SiLU, down, the residuals; and, as options
// (data: LayerOptions and the constructor's act), what newer families add: GELU-tanh in place of SiLU, an RMS norm
// of each q and k head before rope, RMS norms of the attention and MLP outputs before their residual adds, a rope
// table and an attention scale per layer. Norm weights are the multipliers themselves (a loader folds in any
// offset, such as Gemma's 1 + w). Every token is
// computed on its own (norms per token or head, linears row-independent (common.h), attention per query over its allowed
// keys in key order), so a token's result does not depend on T, on the other rows of a batch, or on the thread
// split. The element-wise code is compiled for the baseline instruction set (the reference, which the scalar path
// runs) and, where a SIMD path runs, in AVX2 (exp, attention: written out in 8-lane intrinsics; norms, SiLU's
// arithmetic: the same C++ compiled for AVX2 without FMA contraction), the same operations per element in the
// same order, so the same bits.

namespace {

struct PackedPart {
  torch::Tensor q, s, m;         // m: empty when absent (int8, int6); one element: every minimum is that multiple
  int64_t rows;                  // of its scale (Q4_0: -8)
  torch::Tensor ss, ms;          // K-quants: the fp16 super-block scales s and m are int8 multiples of; else empty
  float mk = 0.f;                // that multiple, read once (make_part)
  W view(int64_t K, int64_t ldy) const {
    const bool int4 = m.numel() > 0, shared_min = m.numel() == 1;
    W w{q.data_ptr<uint8_t>(), s.data_ptr(), int4 && !shared_min ? m.data_ptr() : nullptr, rows, int(K / QK),
        int4, !int4 && s.numel() == 2 * ((rows + RG - 1) / RG) * (K / QK) * RG, ldy, s.scalar_type() == torch::kHalf};
    w.mk = mk;
    if (ss.numel()) w.ss = reinterpret_cast<const uint16_t*>(ss.data_ptr());
    if (ms.numel()) w.ms = reinterpret_cast<const uint16_t*>(ms.data_ptr());
    return w;
  }
};

PackedPart make_part(const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& m, int64_t rows,
                     const torch::Tensor& ss, const torch::Tensor& ms) {
  PackedPart p{q.contiguous(), s.contiguous(), m.contiguous(), rows, ss.contiguous(), ms.contiguous()};
  if (m.numel() == 1) p.mk = one_value(m);
  return p;
}

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
  std::vector<float> stream;                         // a ragged block's tokens' residual stream (widths)
  std::vector<std::vector<int64_t>> wkeys, wnkeys;   // per (window, ring) the layers have: each query's key slots
};

// v with at least n elements (grown when short; its contents are the caller's to write)
template <typename V>
V& grown(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v;
}

// A layer's options beyond the Llama layer; a Llama layer sets none (add_layer's keyword arguments).
struct LayerOptions {
  torch::Tensor q_norm, k_norm;       // [D] fp32: RMS norm of each q / k head before rope; undefined: none
  torch::Tensor post_attn, post_mlp;  // [hid] fp32: RMS norm of the attention / MLP output before its residual add
  int64_t rope = 0;                   // which table of cis [R, P, D / 2, 2] (cis [P, D / 2, 2]: the one, 0)
  float scale = 0.f;                  // attention scale (softmax(q k^T scale)); set by make_options
  int64_t window = 0;                 // > 0: a query at position p attends keys at positions > p - window
};

// forward()'s rings: per layer, the slots its cache keeps when it is a ring (slot j at j % ring; cache/kv_cache.py:
// why a window's keys survive there), 0 (or absent) for a cache that holds every slot
inline int64_t ring_of(const std::vector<int64_t>& rings, int64_t layer) {
  return layer < int64_t(rings.size()) ? rings[layer] : 0;
}

// a norm weight of n elements as fp32, or undefined when absent
inline torch::Tensor norm_weight(const c10::optional<torch::Tensor>& w, int64_t n, const char* name) {
  if (!w.has_value() || !w->defined()) return torch::Tensor();
  TORCH_CHECK(w->numel() == n, name, ": ", n, " elements, got ", w->numel());
  return w->contiguous().to(torch::kFloat);
}

struct Layer {
  torch::Tensor ln1, ln2;             // [hid]: the norms before attention and before the MLP
  PackedLinear qkv, o, gate_up, down;      // packed quantized weights (add_layer)
  DenseLinear dqkv, dout, dgate_up, ddown; // or dense ones, fp32 or bf16 (add_dense_layer)
  bool dense = false;
  LayerOptions opt;
};

inline const float* data_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

class Decoder {
 public:
  // act: the MLP's activation, "silu" or "gelu_tanh"; eps: every RMS norm's
  Decoder(int64_t H, int64_t Hkv, int64_t D, int64_t hid, int64_t inter, double eps, int64_t path,
          const std::string& act = "silu")
      : H(H), Hkv(Hkv), D(D), hid(hid), inter(inter), eps(float(eps)), path(int(path)) {
    TORCH_CHECK(path != AMX || amx_permitted(), "path 3 (AMX): the operating system does not grant the tile registers");
    TORCH_CHECK(D % 8 == 0 && hid % 8 == 0 && inter % 8 == 0 && H % Hkv == 0,
                "decoder: head_dim, hidden and intermediate sizes multiples of 8");
    TORCH_CHECK(act == "silu" || act == "gelu_tanh", "decoder: act \"silu\" or \"gelu_tanh\", got \"", act, "\"");
    mlp_act = act == "gelu_tanh" ? GELU_TANH : SILU;
  }

  // A layer's options from add_layer's keyword arguments: norms absent when None; scale None: 1 / sqrt(D)
  LayerOptions make_options(const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                            const c10::optional<torch::Tensor>& post_attn, const c10::optional<torch::Tensor>& post_mlp,
                            int64_t rope, c10::optional<double> scale, int64_t window = 0) const {
    LayerOptions o;
    o.q_norm = norm_weight(q_norm, D, "q_norm");
    o.k_norm = norm_weight(k_norm, D, "k_norm");
    TORCH_CHECK(o.q_norm.defined() == o.k_norm.defined(), "q_norm and k_norm: both or neither");
    o.post_attn = norm_weight(post_attn, hid, "post_attn_norm");
    o.post_mlp = norm_weight(post_mlp, hid, "post_mlp_norm");
    TORCH_CHECK(rope >= 0, "rope: a table index >= 0, got ", rope);
    o.rope = rope;
    TORCH_CHECK(!scale.has_value() || *scale > 0, "attn_scale: > 0");
    o.scale = scale.has_value() ? float(*scale) : 1.f / std::sqrt(float(D));
    TORCH_CHECK(window >= 0, "window: >= 0");
    o.window = window;
    return o;
  }

  // linears in the order q/k/v, o, gate/up, down: each a list of row blocks (qp, sp, mp or empty, rows), and a
  // bias or empty
  void add_layer(torch::Tensor ln1, torch::Tensor ln2, std::vector<std::vector<torch::Tensor>> qp,
                 std::vector<std::vector<torch::Tensor>> sp, std::vector<std::vector<torch::Tensor>> mp,
                 std::vector<torch::Tensor> bias, std::vector<std::vector<int64_t>> rows, LayerOptions opt,
                 std::vector<std::vector<torch::Tensor>> ss = {}, std::vector<std::vector<torch::Tensor>> ms = {}) {
    TORCH_CHECK(qp.size() == 4 && sp.size() == 4 && mp.size() == 4 && bias.size() == 4 && rows.size() == 4,
                "add_layer: four linears");
    TORCH_CHECK(hid % QK == 0 && inter % QK == 0 && (H * D) % QK == 0,
                "add_layer: quantized linears need hidden and intermediate sizes multiples of 32");
    const int64_t want[4] = {(H + 2 * Hkv) * D, hid, 2 * inter, hid};
    const int64_t in_features[4] = {hid, H * D, hid, inter};
    for (auto* sup : {&ss, &ms}) {
      TORCH_CHECK(sup->empty() || sup->size() == 4, "add_layer: ss and ms: none, or one list per linear");
      for (size_t i = 0; i < sup->size(); ++i)
        TORCH_CHECK((*sup)[i].size() == qp[i].size(), "add_layer: linear ", i, ": one ss and ms per part");
    }
    PackedLinear p[4];
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(!qp[i].empty() && sp[i].size() == qp[i].size() && mp[i].size() == qp[i].size() &&
                  rows[i].size() == qp[i].size(), "add_layer: linear ", i, ": one (q, s, m, rows) per part");
      int64_t total = 0;
      for (size_t j = 0; j < qp[i].size(); ++j) {
        const auto st = sp[i][j].scalar_type();
        const torch::Tensor none;
        const torch::Tensor& s_sup = ss.empty() ? none : ss[i][j];
        const torch::Tensor& m_sup = ms.empty() ? none : ms[i][j];
        const bool factored = s_sup.defined() && s_sup.numel() > 0;
        TORCH_CHECK((factored ? st == torch::kChar && s_sup.scalar_type() == torch::kHalf
                              : st == torch::kFloat || st == torch::kHalf) &&
                        (mp[i][j].numel() <= 1 || mp[i][j].scalar_type() == st) &&
                        ((m_sup.defined() && m_sup.numel() > 0) == (factored && mp[i][j].numel() > 1)) &&
                        (!factored || in_features[i] % 256 == 0),
                    "add_layer: linear ", i, ": scales fp32 or fp16, or int8 with fp16 super-block scales ",
                    "(K a multiple of 256); minimums in the scales' type");
        p[i].parts.push_back(make_part(qp[i][j], sp[i][j], mp[i][j], rows[i][j], s_sup.defined() ? s_sup : torch::empty({0}),
                                       m_sup.defined() ? m_sup : torch::empty({0})));
        total += rows[i][j];
      }
      TORCH_CHECK(total == want[i], "add_layer: linear ", i, " has ", total, " rows, expected ", want[i]);
      p[i].bias = bias[i].contiguous().to(torch::kFloat);
      p[i].rows = total;
    }
    Layer L{ln1.contiguous().to(torch::kFloat), ln2.contiguous().to(torch::kFloat), p[0], p[1], p[2], p[3]};
    L.opt = std::move(opt);
    layers.push_back(L);
  }

  // a layer of dense weights (fp32, or bf16 where that holds them exactly): w = [q/k/v [(H + 2 Hkv) D, hid], o [hid, H D], gate/up [2 inter, hid],
  // down [hid, inter]], bias = one per linear, or empty
  void add_dense_layer(torch::Tensor ln1, torch::Tensor ln2, std::vector<torch::Tensor> w,
                       std::vector<torch::Tensor> bias, LayerOptions opt) {
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
    L.opt = std::move(opt);
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
  // [P, D / 2, 2] fp32 (cos, sin), or [R, P, D / 2, 2] (layer i reads table rope_i); run: the layers to run, in
  // order; kv_len = the keys attended (S); widths: empty (every row's T tokens), or [B] with row b's first
  // widths[b] tokens computed and the rest padding: neither computed nor written to the cache, left as given in
  // the output (a batch whose rows verify drafts of different lengths pays for its real tokens alone).
  torch::Tensor forward(torch::Tensor x, int64_t B, int64_t T, std::vector<torch::Tensor> cache_k,
                        std::vector<torch::Tensor> cache_v, std::vector<int64_t> lens, torch::Tensor pos,
                        torch::Tensor mask, torch::Tensor cis, std::vector<int64_t> run, int64_t kv_len,
                        std::vector<int64_t> rings = {}, std::vector<int64_t> widths = {}) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) == B * T && x.size(1) == hid && x.scalar_type() == torch::kFloat,
                "x: fp32 [B * T, hidden]");
    torch::Tensor out = x.clone();
    run_layers(out.data_ptr<float>(), B, T, cache_k, cache_v, lens, pos, mask, cis, run, kv_len, rings, widths);
    return out;
  }

  // the layers `run` over the residual stream xp [B * T, hid], in place (see forward); with widths, over the
  // tokens they name only (gathered into a stream of their own, scattered back at the end)
  void run_layers(float* xp, int64_t B, int64_t T, std::vector<torch::Tensor>& cache_k,
                  std::vector<torch::Tensor>& cache_v, const std::vector<int64_t>& lens, const torch::Tensor& pos,
                  const torch::Tensor& mask, const torch::Tensor& cis, const std::vector<int64_t>& run,
                  int64_t kv_len, const std::vector<int64_t>& rings = {}, const std::vector<int64_t>& widths = {}) {
    TORCH_CHECK(int64_t(lens.size()) >= B && pos.scalar_type() == torch::kLong &&
                (pos.numel() == B * T || pos.numel() == 0), "lens, pos");
    TORCH_CHECK(cis.scalar_type() == torch::kFloat && (cis.dim() == 3 || cis.dim() == 4) && cis.size(-2) * 2 == D &&
                cis.size(-1) == 2, "cis: fp32 [P, D/2, 2] or [R, P, D/2, 2]");
    const int64_t tables = cis.dim() == 4 ? cis.size(0) : 1, P = cis.size(-3);
    TORCH_CHECK(mask.numel() == 0 || (mask.scalar_type() == torch::kBool && mask.numel() == B * T * kv_len),
                "mask: bool [B, T, S]");
    TORCH_CHECK(cache_k.size() >= layers.size() && cache_v.size() >= layers.size(), "cache: one tensor per layer");
    TORCH_CHECK(widths.empty() || int64_t(widths.size()) == B, "widths: none, or one per row");
    // the tokens computed, in row order: tok[i] = b * T + t (every one without widths)
    bool ragged = false;
    for (int64_t b = 0; b < int64_t(widths.size()); ++b) {
      TORCH_CHECK(widths[b] >= 0 && widths[b] <= T, "widths[", b, "] = ", widths[b], " outside 0..", T);
      ragged = ragged || widths[b] < T;
    }
    std::vector<int64_t> tok;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < (ragged ? widths[b] : T); ++t) tok.push_back(b * T + t);
    const int64_t M = int64_t(tok.size());
    // the calling thread's buffers, kept between forwards and grown, never shrunk: allocated and zeroed per
    // forward, the larger ones come from fresh pages each time (a forward over 16 or 32 tokens), and the next
    // small forward runs slower after them
    static thread_local LayerScratch scratch;
    float* full = xp;                        // the caller's [B * T, hid]; the layers run over M rows of their own
    if (ragged) {
      xp = grown(scratch.stream, M * hid).data();
      for (int64_t i = 0; i < M; ++i) std::memcpy(xp + i * hid, full + tok[i] * hid, sizeof(float) * hid);
    }
    // no positions given: row b's token t sits at lens[b] + t
    std::vector<int64_t> own;
    if (pos.numel() == 0) {
      own.resize(B * T);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) own[b * T + t] = lens[b] + t;
    }
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(lens[b] + T <= P, "position ", lens[b] + T - 1, " beyond the rope table's ", P);
    auto posc = pos.contiguous();
    const int64_t* posp = pos.numel() ? posc.data_ptr<int64_t>() : own.data();
    auto maskc = mask.contiguous();
    auto cisc = cis.contiguous();
    auto& h = grown(scratch.h, M * hid);
    auto& qkv = grown(scratch.qkv, M * (H + 2 * Hkv) * D);
    auto& att = grown(scratch.att, M * H * D);
    auto& tmp = grown(scratch.tmp, M * hid);
    auto& gu = grown(scratch.gu, M * 2 * inter);
    auto& act = grown(scratch.act, M * inter);
    // the cache slots each query attends, in key order: one list per (window, ring) among the layers run (a
    // windowed layer drops keys older than its window; a ring layer's slot j lies at j % ring)
    const bool* mp = maskc.numel() ? maskc.data_ptr<bool>() : nullptr;
    std::vector<std::pair<int64_t, int64_t>> kinds;                  // (window, ring), in first-use order
    std::vector<size_t> kind_of(layers.size(), 0);
    for (int64_t li : run) {
      TORCH_CHECK(li >= 0 && li < int64_t(layers.size()), "layer ", li, " out of range");
      const auto kind = std::make_pair(layers[li].opt.window, ring_of(rings, li));
      size_t k = 0;
      while (k < kinds.size() && kinds[k] != kind) ++k;
      if (k == kinds.size()) kinds.push_back(kind);
      kind_of[li] = k;
    }
    if (scratch.wkeys.size() < kinds.size()) scratch.wkeys.resize(kinds.size()), scratch.wnkeys.resize(kinds.size());
    for (size_t k = 0; k < kinds.size(); ++k) {
      const int64_t win = kinds[k].first, ring = kinds[k].second;
      auto& keys = grown(scratch.wkeys[k], M * kv_len);
      auto& nkeys = grown(scratch.wnkeys[k], M);
      for (int64_t i = 0; i < M; ++i) {
          const int64_t bt = tok[i], b = bt / T, t = bt % T, qpos = posp[bt];
          int64_t n = 0;
          // a committed slot j holds position j; the block's slot lens[b] + u holds its token u's position
          const int64_t first = win > 0 ? std::max<int64_t>(0, std::min(lens[b], qpos - win + 1)) : 0;
          for (int64_t j = first; j < kv_len; ++j) {
            if (!(mp ? mp[bt * kv_len + j] : j <= lens[b] + t)) continue;
            if (win > 0) {
              const int64_t kpos = j < lens[b] ? j : posp[b * T + (j - lens[b])];
              if (qpos - kpos >= win) continue;
            }
            keys[i * kv_len + n++] = ring > 0 ? j % ring : j;
          }
          nkeys[i] = n;
      }
    }
    const float* pending = nullptr;          // the MLP's output not yet added to the residual stream
    for (int64_t li : run) {
      const Layer& L = layers[li];
      TORCH_CHECK(L.opt.rope < tables, "layer ", li, " reads rope table ", L.opt.rope, " of ", tables);
      auto& ck = cache_k[li];
      auto& cv = cache_v[li];
      TORCH_CHECK(ck.is_contiguous() && cv.is_contiguous() && ck.scalar_type() == torch::kFloat &&
                  ck.size(0) >= B && ck.size(1) == Hkv && ck.size(3) == D &&
                  ck.size(2) >= (ring_of(rings, li) > 0 ? ring_of(rings, li) : kv_len),
                  "cache: contiguous fp32 [B, Hkv, capacity, D] (a ring layer's: its ring)");
      add_norm(xp, pending, L.ln1.data_ptr<float>(), M, h.data());         // the previous layer's residual
      {
        Span span(R_QKV);
        linear(L.qkv, L.dqkv, L.dense, h.data(), M, hid, qkv.data());
      }
      {
        Span span(R_ROPE);
        rope_and_store(qkv.data(), tok, T, posp, cisc.data_ptr<float>() + L.opt.rope * P * D, L.opt,
                       ring_of(rings, li), lens, ck, cv);
      }
      {
        Span span(R_ATTN);
        const size_t k = kind_of[li];
        attention(qkv.data(), tok, T, scratch.wkeys[k].data(), scratch.wnkeys[k].data(), ck, cv, kv_len, L.opt.scale,
                  att.data());
      }
      {
        Span span(R_O);
        linear(L.o, L.dout, L.dense, att.data(), M, H * D, tmp.data());
      }
      if (L.opt.post_attn.defined()) add_norm(tmp.data(), nullptr, L.opt.post_attn.data_ptr<float>(), M, tmp.data());
      add_norm(xp, tmp.data(), L.ln2.data_ptr<float>(), M, h.data());
      {
        Span span(R_GATE_UP);
        linear(L.gate_up, L.dgate_up, L.dense, h.data(), M, hid, gu.data());
      }
      {
        Span span(R_SILU);
        over_rows(M, 8, [&](int64_t m0, int64_t m1) {
          (path > 0 ? glu_avx2 : glu_base)(mlp_act, gu.data(), m0, m1, inter, act.data());
        });
      }
      {
        Span span(R_DOWN);
        linear(L.down, L.ddown, L.dense, act.data(), M, inter, tmp.data());
      }
      if (L.opt.post_mlp.defined()) add_norm(tmp.data(), nullptr, L.opt.post_mlp.data_ptr<float>(), M, tmp.data());
      pending = tmp.data();
    }
    if (pending) {
      Span span(R_RESID);
      for (int64_t i = 0; i < M * hid; ++i) xp[i] += pending[i];
    }
    if (ragged)
      for (int64_t i = 0; i < M; ++i) std::memcpy(full + tok[i] * hid, xp + i * hid, sizeof(float) * hid);
  }

  int64_t num_layers() const { return int64_t(layers.size()); }

 private:
  int64_t H, Hkv, D, hid, inter;
  float eps;
  int path;
  int mlp_act = SILU;                      // MlpAct (layer_math.h)
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

  // with the layer's q/k norms, normalize each q and k head (a row of D); rotate each q and k head's pairs (2i, 2i+1)
  // by the position's (cos, sin) in the table cis [P, D / 2, 2]; write k and v to the cache slots. qkv's row i is
  // token tok[i] = b * T + t.
  void rope_and_store(float* qkv, const std::vector<int64_t>& tok, int64_t T, const int64_t* pos, const float* cis,
                      const LayerOptions& opt, int64_t ring, const std::vector<int64_t>& lens, torch::Tensor& ck,
                      torch::Tensor& cv) {
    const float* qn = data_or_null(opt.q_norm);
    const float* kn = data_or_null(opt.k_norm);
    auto norm_heads = path > 0 ? add_norm_avx2 : add_norm_base;
    const int64_t width = (H + 2 * Hkv) * D, cap = ck.size(2);
    float* kp = ck.data_ptr<float>();
    float* vp = cv.data_ptr<float>();
    for (size_t i = 0; i < tok.size(); ++i) {
        const int64_t b = tok[i] / T, t = tok[i] % T;
        float* row = qkv + int64_t(i) * width;
        const float* c = cis + pos[tok[i]] * D;
        if (qn) {
          norm_heads(row, nullptr, qn, 0, H, D, eps, row);                   // the H q heads, in place
          norm_heads(row + H * D, nullptr, kn, 0, Hkv, D, eps, row + H * D);   // the Hkv k heads
        }
        for (int64_t hh = 0; hh < H + Hkv; ++hh) {
          float* v = row + hh * D;
          for (int64_t i = 0; i < D / 2; ++i) {
            const float a = v[2 * i], bb = v[2 * i + 1], co = c[2 * i], si = c[2 * i + 1];
            v[2 * i] = a * co - bb * si;
            v[2 * i + 1] = a * si + bb * co;
          }
        }
        const int64_t slot = ring > 0 ? (lens[b] + t) % ring : lens[b] + t;
        for (int64_t g = 0; g < Hkv; ++g) {
          std::memcpy(kp + ((b * Hkv + g) * cap + slot) * D, row + (H + g) * D, sizeof(float) * D);
          std::memcpy(vp + ((b * Hkv + g) * cap + slot) * D, row + (H + Hkv + g) * D, sizeof(float) * D);
        }
    }
  }

  // softmax(q k^T * scale) v per (token, head) over the allowed keys in key order; qkv's and out's row i, and
  // keys' / nkeys', are token tok[i] = b * T + t's
  void attention(const float* qkv, const std::vector<int64_t>& tok, int64_t T, const int64_t* keys,
                 const int64_t* nkeys, const torch::Tensor& ck, const torch::Tensor& cv, int64_t S, float scale,
                 float* out) {
    const int64_t width = (H + 2 * Hkv) * D, cap = ck.size(2), rep = H / Hkv, M = int64_t(tok.size());
    const float* kp = ck.data_ptr<float>();
    const float* vp = cv.data_ptr<float>();
    const bool wide = path > 0;
    const int64_t work = M * H * S * D;
    // one item per (head, token): the queries of a block spread evenly over the threads
    const int64_t items = M * H;
    const int64_t grain = work > (1 << 18) ? std::max<int64_t>(1, items / (8 * int64_t(at::get_num_threads()))) : items;
    leaplm_pool::parallel_for(items, grain, [&](int64_t i0, int64_t i1) {
      static thread_local std::vector<float> scores;           // a query's softmax over its keys
      std::vector<float>& p = grown(scores, S);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t m = i % M, hh = i / M, b = tok[m] / T, g = hh / rep;   // a head's tokens side by side
        const float* kb = kp + (b * Hkv + g) * cap * D;
        const float* vb = vp + (b * Hkv + g) * cap * D;
        const float* q = qkv + m * width + hh * D;
        const int64_t* ks = keys + m * S;
        float* dst = out + m * H * D + hh * D;
        if (wide) attend_avx2(q, kb, vb, ks, nkeys[m], D, scale, p.data(), dst);
        else attend_base(q, kb, vb, ks, nkeys[m], D, scale, p.data(), dst);
      }
    });
  }

  // x += d (d may be null), then h = rms_norm(x) * w, per row of hid (h may be x: a norm in place)
  void add_norm(float* x, const float* d, const float* w, int64_t M, float* h) {
    Span span(R_NORM);
    if (path > 0) add_norm_avx2(x, d, w, 0, M, hid, eps, h);
    else add_norm_base(x, d, w, 0, M, hid, eps, h);
  }
};


}  // namespace

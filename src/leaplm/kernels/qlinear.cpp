// Quantized linear for 1..32 tokens with 8-bit integer dot products, y[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]),
// and the decoder layer loop built on it: the Python module. The data layouts (block formats, row groups, tile
// shapes) are written down in common.h and in the header of each part.
//
// One translation unit (a unity build): the parts are headers included here, once. The block products are
// templates and always-inline helpers called from the row-group driver's loops under per-function target
// attributes; compiled apart, every call between files would need its definition visible anyway (or lose the
// inlining the hot loops rely on), and each extra translation unit would parse torch/extension.h again (tens of
// seconds a file on first use, when the build runs).
#include <torch/extension.h>

#include <map>
#include <string>
#include <vector>

#include "common.h"
#include "timers.h"
#include "activations.h"
#include "blocks_scalar.h"
#include "blocks_avx2.h"
#include "blocks_vnni.h"
#include "blocks_amx.h"
#include "driver.h"
#include "probes.h"
#include "layer_math.h"
#include "dense.h"
#include "decoder.h"

// Every entry point that computes runs without the GIL (the arguments are converted and the result wrapped while
// it is held): a forward is milliseconds of C++ during which the server's event loop thread must be able to run.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("qlinear", &qlinear, "int8-activation quantized linear for 1..32 tokens over packed weights",
        pybind11::arg("x"), pybind11::arg("qp"), pybind11::arg("sp"), pybind11::arg("mp"), pybind11::arg("bias"),
        pybind11::arg("n"), pybind11::arg("path"), pybind11::arg("ss") = pybind11::none(),
        pybind11::arg("ms") = pybind11::none(), nogil());
  m.def("qlinear_argmax", &qlinear_argmax, "qlinear's per-token (max, first argmax) over its N outputs, not written",
        pybind11::arg("x"), pybind11::arg("qp"), pybind11::arg("sp"), pybind11::arg("mp"), pybind11::arg("bias"),
        pybind11::arg("n"), pybind11::arg("path"), pybind11::arg("ss") = pybind11::none(),
        pybind11::arg("ms") = pybind11::none(), nogil());
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
  using pybind11::arg;
  using OptTensor = c10::optional<torch::Tensor>;
  using Parts = std::vector<std::vector<torch::Tensor>>;
  // a layer's options (decoder.h LayerOptions), keyword arguments of add_layer and add_dense_layer: None or absent
  // is the Llama layer's (no q/k or post norms, rope table 0, scale 1 / sqrt(head_dim), no window)
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t, const std::string&>(),
           arg("n_heads"), arg("n_kv_heads"), arg("head_dim"), arg("hidden"), arg("intermediate"), arg("eps"),
           arg("path"), arg("act") = "silu")
      .def("add_layer",
           [](Decoder& d, torch::Tensor ln1, torch::Tensor ln2, Parts qp, Parts sp, Parts mp,
              std::vector<torch::Tensor> bias, std::vector<std::vector<int64_t>> rows, OptTensor q_norm,
              OptTensor k_norm, OptTensor post_attn_norm, OptTensor post_mlp_norm, int64_t rope,
              c10::optional<double> attn_scale, int64_t window, Parts ss, Parts ms) {
             d.add_layer(ln1, ln2, qp, sp, mp, bias, rows,
                         d.make_options(q_norm, k_norm, post_attn_norm, post_mlp_norm, rope, attn_scale, window),
                         ss, ms);
           },
           arg("ln1"), arg("ln2"), arg("qp"), arg("sp"), arg("mp"), arg("bias"), arg("rows"),
           arg("q_norm") = pybind11::none(), arg("k_norm") = pybind11::none(), arg("post_attn_norm") = pybind11::none(),
           arg("post_mlp_norm") = pybind11::none(), arg("rope") = 0, arg("attn_scale") = pybind11::none(),
           arg("window") = 0, arg("ss") = Parts(), arg("ms") = Parts())
      .def("add_dense_layer",
           [](Decoder& d, torch::Tensor ln1, torch::Tensor ln2, std::vector<torch::Tensor> w,
              std::vector<torch::Tensor> bias, OptTensor q_norm, OptTensor k_norm, OptTensor post_attn_norm,
              OptTensor post_mlp_norm, int64_t rope, c10::optional<double> attn_scale, int64_t window) {
             d.add_dense_layer(ln1, ln2, w, bias,
                               d.make_options(q_norm, k_norm, post_attn_norm, post_mlp_norm, rope, attn_scale, window));
           },
           arg("ln1"), arg("ln2"), arg("w"), arg("bias"), arg("q_norm") = pybind11::none(),
           arg("k_norm") = pybind11::none(), arg("post_attn_norm") = pybind11::none(),
           arg("post_mlp_norm") = pybind11::none(), arg("rope") = 0, arg("attn_scale") = pybind11::none(),
           arg("window") = 0)
      .def("set_head", &Decoder::set_head)
      .def("forward", &Decoder::forward, nogil(), arg("x"), arg("B"), arg("T"), arg("cache_k"), arg("cache_v"),
           arg("lens"), arg("pos"), arg("mask"), arg("cis"), arg("run"), arg("kv_len"),
           arg("rings") = std::vector<int64_t>(), arg("widths") = std::vector<int64_t>())
      .def("logits", &Decoder::logits, nogil())
      .def("greedy_chain", &Decoder::greedy_chain, nogil())
      .def("num_layers", &Decoder::num_layers);
}

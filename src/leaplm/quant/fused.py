"""The C++ layer loop (kernels/decoder.h, `Decoder`) for a native model whose linears all run in the int8 kernel.

A forward over 1..16 tokens is a few milliseconds of matrix work on a small model; run from Python, the ~20 other
operations of each layer (norms, rope, the cache write, attention, SiLU, residuals) cost about as much again in
dispatch. The layer loop runs them in one call, per token, in a fixed order: a token's result does not depend on
how many tokens or rows share the forward, so plain decoding and verification compute it alike.

It applies when every decoder linear is quantized on the extension, the model and the KV cache are fp32 and the
activation is SiLU or GELU-tanh; otherwise the model runs its PyTorch layer loop. What the loop computes beyond a
Llama layer is data, built here from the model's description (decoder_options): the activation, per-head q/k norms
(qwen3), and, per layer, post-attention and post-MLP norms, the rope table, the attention scale and the sliding
window with its ring cache. This module is the only place that reads the model's fields for the layer loop.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .. import faults

log = logging.getLogger(__name__)


# hidden_act names (transformers' ACT2FN keys) -> the layer loop's activation (Decoder's act)
LOOP_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


@dataclass
class LayerOptions:
    """One layer's options beyond the Llama layer: Decoder.add_layer's keyword arguments (kernels/decoder.h). Norm
    weights are the multipliers themselves (a loader folds in any offset, such as Gemma's 1 + w)."""
    q_norm: torch.Tensor | None = None          # [head_dim]: RMS norm of each q head before rope (qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None          # [head_dim]: the same for each k head; both or neither
    post_attn_norm: torch.Tensor | None = None  # [hid]: RMS norm of the attention output before its residual add
    post_mlp_norm: torch.Tensor | None = None   # [hid]: RMS norm of the MLP output before its residual add
    rope: int = 0                               # which table of DecoderOptions.cis the layer rotates by
    attn_scale: float | None = None             # softmax(q k^T attn_scale); None: 1 / sqrt(head_dim)
    window: int = 0                             # > 0: keys within this many positions of the query

    def kwargs(self) -> dict:
        return {"q_norm": self.q_norm, "k_norm": self.k_norm, "post_attn_norm": self.post_attn_norm,
                "post_mlp_norm": self.post_mlp_norm, "rope": self.rope, "attn_scale": self.attn_scale,
                "window": self.window}


@dataclass
class DecoderOptions:
    """What the layer loop computes for one model, as data."""
    act: str                                    # "silu" | "gelu_tanh": the gated MLP's activation
    cis: torch.Tensor                           # [P, head_dim / 2, 2] or [R, P, head_dim / 2, 2] fp32 (cos, sin)
    layers: list[LayerOptions] = field(default_factory=list)   # one per decoder layer


@dataclass
class FusedLayers:
    """The C++ decoder over a model's packed weights, and the rope tables it reads."""
    decoder: object              # the extension's Decoder
    cis: torch.Tensor            # [P, head_dim / 2, 2] fp32: (cos, sin) per position and pair ([R, P, ...]: R tables)

    def __call__(self, x: torch.Tensor, cache, pos: torch.Tensor, mask: torch.Tensor | None, layers,
                 kv_len: int, widths: list[int] | None = None) -> torch.Tensor:
        """x [B, T, hid] -> [B, T, hid] after `layers` (indices, in order); K/V written at each row's length.
        widths [B]: row b's first widths[b] tokens alone are computed and cached (the rest pass through as given)."""
        B, T, hid = x.shape
        m = torch.empty(0, dtype=torch.bool) if mask is None else mask.reshape(B, T, kv_len)
        run = list(layers)
        if faults.PLAN and faults.at("kernel", int(pos.max())):
            run.insert(len(run) // 2, -1)        # the loop's own layer check throws there (faults.py)
        y = self.decoder.forward(x.reshape(B * T, hid).contiguous(), B, T, cache.k, cache.v, cache.lengths[:B],
                                 pos.expand(B, T).contiguous(), m, self.cis, run, kv_len, getattr(cache, "rings", []),
                                 widths or [])
        return y.view(B, T, hid)


def why_not_fused(model) -> str | None:
    """Why the C++ layer loop does not apply to `model`, or None when it does."""
    a = model.args
    q = getattr(model, "quantized", {})
    names = [f"layers.{i}.{n}.weight" for i in range(a.num_hidden_layers)
             for n in ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up", "mlp.down_proj")]
    if not q:
        return "the linears are not quantized"
    if any(getattr(q.get(n), "backend", None) != "extension" for n in names):
        return "not every decoder linear runs in the int8 kernel"
    if model.dtype != torch.float32:
        return f"the model is {model.dtype}, the layer loop computes in fp32"
    if a.hidden_act not in LOOP_ACTIVATIONS:
        return f"hidden_act {a.hidden_act!r} (the layer loop implements SiLU and GELU-tanh)"
    if a.head_dim % 8 or a.hidden_size % 32 or a.intermediate_size % 32:
        return "head_dim not a multiple of 8 or a hidden size not a multiple of 32"
    return None


def decoder_options(model) -> DecoderOptions:
    """The layer loop's options for `model`, read from its description: the activation; per layer the q/k norm
    weights when the family has them (args.qk_norm), the norms of the attention and MLP outputs (args.post_norms:
    Gemma 3's post_attention_layernorm / post_feedforward_layernorm; its pre-MLP norm is add_layer's ln2), which rope
    table it rotates by (a second table where its base is not rope_theta: Gemma 3's sliding layers), the attention
    scale (query_pre_attn_scalar ** -0.5) and its sliding window (the ring a cache keeps for it is the cache's:
    FusedLayers passes cache.rings). The embedding scale stays with the embedding (models/llama.py)."""
    a = model.args
    local = model.rope_cis_local is not None
    layers = []
    for i, blk in enumerate(model.layers):
        at = blk.self_attn
        layers.append(LayerOptions(
            q_norm=at.q_norm.weight.detach() if a.qk_norm else None,
            k_norm=at.k_norm.weight.detach() if a.qk_norm else None,
            post_attn_norm=at.post_norm.weight.detach() if a.post_norms else None,
            post_mlp_norm=blk.mlp.post_norm.weight.detach() if a.post_norms else None,
            rope=1 if local and a.layer_theta(i) != a.rope_theta else 0,
            attn_scale=a.attn_scale, window=a.layer_window(i) or 0))
    cis = torch.view_as_real(model.rope_cis).contiguous()                      # [P, D/2, 2]
    if local:
        cis = torch.stack([cis, torch.view_as_real(model.rope_cis_local)]).contiguous()   # [2, P, D/2, 2]
    return DecoderOptions(LOOP_ACTIVATIONS[a.hidden_act], cis, layers)


def build_fused(model) -> FusedLayers | None:
    """FusedLayers for `model`, or None (logged once with the reason) when the PyTorch loop must run."""
    why = why_not_fused(model)
    if why is not None:
        if getattr(model, "quantized", None):
            log.info("decoder layers: PyTorch loop (%s)", why)
        return None
    a = model.args
    q = model.quantized
    ext = next(iter(q.values())).parts[0].ext
    opts = decoder_options(model)
    dec = ext.module.Decoder(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.hidden_size,
                             a.intermediate_size, a.rms_norm_eps, ext.path, act=opts.act)
    empty = torch.empty(0)
    for i, blk in enumerate(model.layers):
        lins = [q[f"layers.{i}.{n}.weight"] for n in ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up",
                                                      "mlp.down_proj")]
        biases = [blk.self_attn.qkv.bias, blk.self_attn.o_proj.bias, blk.mlp.gate_up.bias, blk.mlp.down_proj.bias]
        parts = [[p.packed for p in lin.parts] for lin in lins]          # a split linear's row blocks in order
        dec.add_layer(blk.input_layernorm.weight.detach(), blk.post_attention_layernorm.weight.detach(),
                      [[p.q for p in ps] for ps in parts], [[p.scale for p in ps] for ps in parts],
                      [[empty if p.minv is None else p.minv for p in ps] for ps in parts],
                      [empty if b is None else b.detach() for b in biases], [[p.rows for p in ps] for ps in parts],
                      **opts.layers[i].kwargs(),
                      ss=[[empty if p.ss is None else p.ss for p in ps] for ps in parts],
                      ms=[[empty if p.ms is None else p.ms for p in ps] for ps in parts])
    log.info("decoder layers: C++ layer loop (%d layers, %s path, %s)", a.num_hidden_layers, ext.path_name, opts.act)
    return FusedLayers(dec, opts.cis)

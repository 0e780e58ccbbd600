"""The C++ layer loop (kernels/qlinear.cpp, `Decoder`) for a native model whose linears all run in the int8 kernel.

A forward over 1..16 tokens is a few milliseconds of matrix work on a small model; run from Python, the ~20 other
operations of each layer (norms, rope, the cache write, attention, SiLU, residuals) cost about as much again in
dispatch. The layer loop runs them in one call, per token, in a fixed order: a token's result does not depend on
how many tokens or rows share the forward, so plain decoding and verification compute it alike.

It applies when every decoder linear is quantized on the extension, the model and the KV cache are fp32, the
activation is SiLU and there is no per-head q/k norm (qwen3); otherwise the model runs its PyTorch layer loop.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import faults

log = logging.getLogger(__name__)


@dataclass
class FusedLayers:
    """The C++ decoder over a model's packed weights, and the rope table it reads."""
    decoder: object              # the extension's Decoder
    cis: torch.Tensor            # [P, head_dim / 2, 2] fp32: (cos, sin) per position and pair

    def __call__(self, x: torch.Tensor, cache, pos: torch.Tensor, mask: torch.Tensor | None, layers,
                 kv_len: int) -> torch.Tensor:
        """x [B, T, hid] -> [B, T, hid] after `layers` (indices, in order); K/V written at each row's length."""
        B, T, hid = x.shape
        m = torch.empty(0, dtype=torch.bool) if mask is None else mask.reshape(B, T, kv_len)
        run = list(layers)
        if faults.PLAN and faults.at("kernel", int(pos.max())):
            run.insert(len(run) // 2, -1)        # the loop's own layer check throws there (faults.py)
        y = self.decoder.forward(x.reshape(B * T, hid).contiguous(), B, T, cache.k, cache.v, cache.lengths[:B],
                                 pos.expand(B, T).contiguous(), m, self.cis, run, kv_len)
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
    if a.hidden_act not in ("silu", "swish"):
        return f"hidden_act {a.hidden_act!r} (the layer loop implements SiLU)"
    if a.qk_norm:
        return "per-head q/k norms (qwen3)"
    if a.head_dim % 8 or a.hidden_size % 32 or a.intermediate_size % 32:
        return "head_dim not a multiple of 8 or a hidden size not a multiple of 32"
    return None


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
    dec = ext.module.Decoder(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.hidden_size,
                             a.intermediate_size, a.rms_norm_eps, ext.path)
    empty = torch.empty(0)
    for i, blk in enumerate(model.layers):
        lins = [q[f"layers.{i}.{n}.weight"] for n in ("self_attn.qkv", "self_attn.o_proj", "mlp.gate_up",
                                                      "mlp.down_proj")]
        biases = [blk.self_attn.qkv.bias, blk.self_attn.o_proj.bias, blk.mlp.gate_up.bias, blk.mlp.down_proj.bias]
        parts = [[p.packed for p in lin.parts] for lin in lins]          # a split linear's row blocks in order
        dec.add_layer(blk.input_layernorm.weight.detach(), blk.post_attention_layernorm.weight.detach(),
                      [[p.q for p in ps] for ps in parts], [[p.scale for p in ps] for ps in parts],
                      [[empty if p.minv is None else p.minv for p in ps] for ps in parts],
                      [empty if b is None else b.detach() for b in biases], [[p.rows for p in ps] for ps in parts])
    cis = torch.view_as_real(model.rope_cis).contiguous()                      # [P, D/2, 2]
    log.info("decoder layers: C++ layer loop (%d layers, %s path)", a.num_hidden_layers, ext.path_name)
    return FusedLayers(dec, cis)

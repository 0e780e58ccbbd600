"""A small fp32 model's whole forward in one C++ call (kernels/qlinear.cpp, `Decoder.logits`): the embedding, every
layer, the final norm and the output layer, for chains of new tokens (no tree, no layer subset).

Why: a draft model is small enough that its forward is mostly PyTorch's per-operation cost, and that cost grows
when a target forward has just run. draft-1m (2 layers, hidden size 112) took 0.34 ms a token alone through
PyTorch's ~40 operations, and 0.95 ms when a target forward came first (the target's 128 MB of weights push the
interpreter's and the operators' code and data out of the caches, not only the draft's 5 MB of weights); 3-4x the
cost the policy needs a drafted token to have. In one call the same forward reads the same weights and runs a
fraction of the code, and a weight that bf16 holds exactly (draft-1m's checkpoint is bf16) is read in half the
bytes, widened to the same fp32 number.

Numerics: fp32 throughout, every dot product in the kernel's fixed 8-lane order, attention per query over its keys
in order, so a token's logits do not depend on how many tokens or rows share the forward; they differ from
PyTorch's forward of the same weights by rounding (~1e-6 relative). The loader gives it to drafts only
(models/loading.py): a draft proposes, so its rounding never changes the output, while a target's logits must stay
those of its PyTorch forward.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class OneCallForward:
    """The C++ decoder over a model's fp32 weights, and the rope table it reads."""
    decoder: object              # the extension's Decoder, its layers added with add_dense_layer and set_head
    cis: torch.Tensor            # [P, head_dim / 2, 2] fp32: (cos, sin) per position and pair
    vocab: int                   # rows of the output layer (the logits' last dimension)

    def __call__(self, input_ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] ([B, 1, V] with last_only) after each row's cache length; writes
        the T tokens' K/V there without moving the length (the CausalLM contract)."""
        B, T = input_ids.shape
        cache.check_room(T, B)
        lens = cache.lengths[:B]
        kv_len = max(lens) + T
        empty = _EMPTY
        return self.decoder.logits(input_ids.reshape(-1), B, T, cache.k, cache.v, lens, empty, empty, self.cis,
                                   kv_len, last_only)


    def greedy_chain(self, ids: list[int], k: int, cache, real: int) -> list[int]:
        """k greedy drafts in one call (LlamaForCausalLM.greedy_chain): no Python between the draft's forwards."""
        length = cache.lengths[0]
        cache.check_room(len(ids) + k - 1)
        return self.decoder.greedy_chain(ids, k, cache.k, cache.v, length, self.cis, real)


_EMPTY = torch.empty(0, dtype=torch.long)     # no positions given: row b's token t sits at lens[b] + t; no mask


def why_not_one_call(model) -> str | None:
    """Why `model` (a native LlamaForCausalLM) cannot run its forward in one C++ call, or None when it can."""
    a = model.args
    if getattr(model, "quantized", None) or model.embed_quantized is not None:
        return "its weights are quantized (the C++ layer loop of quant/fused.py runs those)"
    if model.dtype != torch.float32 or (model.cache_dtype or model.dtype) != torch.float32:
        return f"the weights or the cache are {model.cache_dtype or model.dtype}, the call computes in fp32"
    if model.device.type != "cpu":
        return f"it is on {model.device}"
    if a.hidden_act not in ("silu", "swish"):
        return f"hidden_act {a.hidden_act!r} (the call implements SiLU)"
    if a.qk_norm:
        return "per-head q/k norms (qwen3)"
    if a.sliding_window is not None:
        return "a sliding window"
    if a.post_norms or a.embed_scale is not None or a.attn_scale is not None or a.layer_rope_theta is not None:
        return "post-norms, an embedding or attention scale, or RoPE bases per layer (gemma3)"
    if a.head_dim % 8 or a.hidden_size % 8 or a.intermediate_size % 8:
        return "head_dim, hidden or intermediate size not a multiple of 8"
    return None


def kept(w: torch.Tensor) -> torch.Tensor:
    """A weight as the call reads it: in bf16 when bf16 holds every value exactly (a checkpoint stored in bf16, as
    the embedded models are: half the bytes to read for the same numbers), else fp32."""
    w = w.detach().float().contiguous()
    half = w.to(torch.bfloat16)
    return half if torch.equal(half.float(), w) else w


def build_one_call(model) -> OneCallForward | None:
    """OneCallForward for `model`, or None (logged once with the reason) when its PyTorch forward must run."""
    why = why_not_one_call(model)
    ext = None
    if why is None:
        from ..kernels.build import load

        ext = load()
        why = None if ext is not None else "the C++ extension is unavailable"
    if why is not None:
        log.info("forward: PyTorch operations (%s)", why)
        return None
    a = model.args
    dec = ext.module.Decoder(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.hidden_size,
                             a.intermediate_size, a.rms_norm_eps, ext.path)
    empty = torch.empty(0)
    f32 = lambda t: empty if t is None else t.detach().float().contiguous()     # noqa: E731
    for blk in model.layers:
        at, mlp = blk.self_attn, blk.mlp
        dec.add_dense_layer(f32(blk.input_layernorm.weight), f32(blk.post_attention_layernorm.weight),
                            [kept(at.qkv.weight), kept(at.o_proj.weight), kept(mlp.gate_up.weight),
                             kept(mlp.down_proj.weight)],
                            [f32(at.qkv.bias), f32(at.o_proj.bias), f32(mlp.gate_up.bias), f32(mlp.down_proj.bias)])
    embed = kept(model.embed_tokens.weight)
    head = embed if model.lm_head.weight is model.embed_tokens.weight else kept(model.lm_head.weight)
    dec.set_head(embed, f32(model.norm.weight), head)
    cis = torch.view_as_real(model.rope_cis).contiguous()                      # [P, D/2, 2]
    log.info("forward: one C++ call (%d layers, %s path)", a.num_hidden_layers, ext.path_name)
    return OneCallForward(dec, cis, model.lm_head.weight.shape[0])

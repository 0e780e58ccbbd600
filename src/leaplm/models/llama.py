"""Native decoder for every family models/arch/ describes (llama, mistral, qwen2, qwen3, gemma3) over leaplm's
preallocated KV cache; the layer loop reads the family's description (LlamaArgs' fields), never its name.

One forward takes a block of T new tokens per row: T = 1 for decoding, K + 1 for verifying a chain, the
flattened tree for tree verification (with `tree_mask` and `position_offsets`). q/k/v and gate/up
projections are fused into one matmul each at load time: fewer kernels per layer on the hot path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.kv_cache import RING_BLOCK, KVCache
from .base import ModelCapabilities, Scored
from .native_args import ACTIVATIONS, ROPE_TYPES, LlamaArgs, interleave_rope_rows, rope_inv_freq, rope_kind  # noqa: F401
# the Hugging Face config readers, importable from here as before
from .native_config import args_from_hf_config, family, fuse_hf_state_dict, native_blockers  # noqa: F401



def _sdpa_has_gqa() -> bool:
    try:  # enable_gqa arrived in torch 2.5; we support 2.4
        z = torch.zeros(1, 2, 1, 4)
        F.scaled_dot_product_attention(z, z[:, :1], z[:, :1], enable_gqa=True)
        return True
    except TypeError:
        return False


_HAS_GQA = _sdpa_has_gqa()


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or a quantized weight's own kernel (quant/linear.py) when `w` is not a tensor."""
    return F.linear(x, w, bias) if isinstance(w, torch.Tensor) else w(x, bias)


class FastRMSNorm:
    """F.rms_norm for fp32 inputs, bit for bit, without its per-call overhead: F.rms_norm on a one-token row costs
    ~35 us on this class of CPU, most of it wrapping eps and the length as scalars and mean's extra dispatch; the
    same ops on preallocated 0-dim tensors cost ~12 us (tests/models checks the identity). Other dtypes (which
    F.rms_norm computes in fp32) go to F.rms_norm."""

    def __init__(self, dim: int, eps: float, device=None):
        self.dim, self.eps = dim, eps
        self.n = torch.tensor(float(dim), device=device)                       # 0-dim: mean = sum / n
        self.eps_t = torch.tensor(eps, dtype=torch.float32, device=device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or w.dtype != torch.float32:
            return F.rms_norm(x, (self.dim,), w, self.eps)
        v = x.pow(2).sum(-1, keepdim=True).div_(self.n).add_(self.eps_t).rsqrt_()   # [..., 1]
        return (x * v) * w


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] with each rotated pair (j, j + D/2) stored interleaved (see interleave_rope_rows);
    cis [B, T, 1, D/2] complex. One complex multiply instead of rotate-half's slices and concatenation."""
    B, T, H, D = x.shape
    if x.dtype == torch.float32:
        return torch.view_as_real(torch.view_as_complex(x.reshape(B, T, H, D // 2, 2)) * cis).view(B, T, H, D)
    xc = torch.view_as_complex(x.float().reshape(B, T, H, D // 2, 2))
    return torch.view_as_real(xc * cis).view(B, T, H, D).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.h, self.hkv, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.qkv = nn.Linear(a.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=a.attention_bias)
        self.o_proj = nn.Linear(self.h * self.d, a.hidden_size, bias=a.o_bias)
        self.q_norm = RMSNorm(self.d, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(self.d, a.rms_norm_eps) if a.qk_norm else None
        self.post_norm = RMSNorm(a.hidden_size, a.rms_norm_eps) if a.post_norms else None   # on attention's output


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.inter = a.intermediate_size
        self.gate_up = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self.post_norm = RMSNorm(a.hidden_size, a.rms_norm_eps) if a.post_norms else None   # on the MLP's output


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)


@dataclass
class LayerWeights:
    """Direct references to one layer's tensors: the hot loop skips nn.Module dispatch and attribute lookups."""
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None      # post-norms (Gemma): on attention's / the MLP's output
    post_mlp: torch.Tensor | None = None


class LlamaForCausalLM(nn.Module):
    """Implements leaplm's CausalLM protocol (see models/base.py)."""

    capabilities = ModelCapabilities(batch=True, ragged_rows=True, trees=True, hidden_states=True,
                                     layer_subsets=True, greedy_chain=True, argmax_head=True)

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_cis", self.rope_table(a), persistent=False)   # [P, D/2] complex64
        # the RoPE table of layers at another base (Gemma 3's sliding layers), None when every layer uses rope_cis
        self.register_buffer("rope_cis_local", self.local_rope_table(a), persistent=False)   # [P, D/2] | None
        self.register_buffer("positions", torch.arange(a.max_position_embeddings, device=self.rope_cis.device),
                             persistent=False)   # [P]
        self._fast: list[LayerWeights] | None = None
        self._fused = False                  # quant/fused.py's C++ layer loop, None when it does not apply
        self._norms: tuple[FastRMSNorm, FastRMSNorm] | None = None   # (over hidden, over head_dim)
        # parameter name -> a callable standing in for F.linear with that weight (quant/apply.py fills it)
        self.quantized: dict[str, object] = {}
        self.cache_dtype: torch.dtype | None = None   # --kv-cache-dtype; None: the weights' dtype
        # the token embedding kept in a GGUF file's blocks (quant/formats.QuantizedWeight [V, hid]; models/
        # gguf_kernel.py): a forward dequantizes the rows it looks up; None: embed_tokens.weight holds it
        self.embed_quantized = None
        # forward() over chains in one C++ call (models/one_call.py) where it applies; the loader asks it for drafts
        self.one_call = False
        self._one_call = False               # the built OneCallForward, None when it does not apply

    @staticmethod
    def local_rope_table(a: LlamaArgs, device=None) -> torch.Tensor | None:
        other = {a.layer_theta(i) for i in range(a.num_hidden_layers)} - {a.rope_theta}
        if len(other) > 1:
            raise ValueError(f"RoPE bases {sorted(other)}: the native model holds one base besides rope_theta")
        return LlamaForCausalLM.rope_table(a, device, other.pop()) if other else None

    def reset_buffers(self, device) -> None:
        """The non-persistent buffers (RoPE tables, positions) rebuilt on `device` (after a loader assigned weights
        to a meta model)."""
        self.rope_cis = self.rope_table(self.args, device)
        self.rope_cis_local = self.local_rope_table(self.args, device)
        self.positions = torch.arange(self.args.max_position_embeddings, device=device)

    @staticmethod
    def rope_table(a: LlamaArgs, device=None, theta: float | None = None) -> torch.Tensor:
        with torch.device("cpu"):       # computed on the CPU whatever the default device (meta_model: meta)
            inv, scale = rope_inv_freq(a, theta)
            t = torch.arange(a.max_position_embeddings, dtype=torch.float32)
            # |cis| = the rope type's cos/sin scale (yarn), applied to q and k alike as transformers does
            cis = torch.polar(torch.full((len(t), len(inv)), scale), torch.outer(t, inv))   # [P, D/2]
        return cis if device is None else cis.to(device)

    def _apply(self, fn, *args, **kwargs):
        self._fast = self._norms = None    # .to() / .half() replace the tensors we hold references to
        self._one_call = False
        out = super()._apply(fn, *args, **kwargs)
        if not self.rope_cis.is_complex():  # a dtype cast drops the imaginary part: rebuild the tables
            self.rope_cis = self.rope_table(self.args, self.rope_cis.device)
            self.rope_cis_local = self.local_rope_table(self.args, self.rope_cis.device)
        return out

    def layer_weights(self) -> list[LayerWeights]:
        if self._fast is None:
            self._fused = False                    # decided again over the new weights (fused_layers)
            qw = lambda name, w: self.quantized.get(name, w)
            self._fast = [LayerWeights(
                b.input_layernorm.weight, qw(f"layers.{i}.self_attn.qkv.weight", b.self_attn.qkv.weight),
                b.self_attn.qkv.bias,
                b.self_attn.q_norm.weight if b.self_attn.q_norm is not None else None,
                b.self_attn.k_norm.weight if b.self_attn.k_norm is not None else None,
                qw(f"layers.{i}.self_attn.o_proj.weight", b.self_attn.o_proj.weight),
                b.post_attention_layernorm.weight, qw(f"layers.{i}.mlp.gate_up.weight", b.mlp.gate_up.weight),
                qw(f"layers.{i}.mlp.down_proj.weight", b.mlp.down_proj.weight),
                b.self_attn.o_proj.bias, b.mlp.gate_up.bias, b.mlp.down_proj.bias,
                b.self_attn.post_norm.weight if b.self_attn.post_norm is not None else None,
                b.mlp.post_norm.weight if b.mlp.post_norm is not None else None) for i, b in enumerate(self.layers)]
        return self._fast

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> their embeddings [B, T, hid]."""
        if self.embed_quantized is None:
            return F.embedding(input_ids, self.embed_tokens.weight)
        from ..quant.formats import dequantize

        rows = dequantize(self.embed_quantized.rows(input_ids.reshape(-1)))      # [B * T, hid] fp32
        return rows.view(*input_ids.shape, rows.shape[-1])

    def embed_weight(self) -> torch.Tensor:
        """[V, hid] fp32: the token embedding (dequantized when it is held in a file's blocks)."""
        if self.embed_quantized is None:
            return self.embed_tokens.weight.detach().float()
        from ..quant.formats import dequantize

        return dequantize(self.embed_quantized.whole())

    def fused_layers(self):
        """The C++ layer loop over the quantized weights (quant/fused.py), or None."""
        self.layer_weights()
        if self._fused is False:
            from ..quant.fused import build_fused

            self._fused = build_fused(self)
        return self._fused

    def one_call_forward(self):
        """The whole forward in one C++ call (models/one_call.py), or None when it does not apply."""
        if self._one_call is False:
            from .one_call import build_one_call

            self._one_call = build_one_call(self)
        return self._one_call

    def greedy_chain(self, ids: list[int], k: int, cache, real: int) -> list[int] | None:
        """k greedy drafts of a batch-1 cache's row in one C++ call (models/one_call.py), or None when the one-call
        forward does not apply: ids fed after the cache's length, each argmax over the first `real` logits fed
        next; the cache then holds ids and the first k - 1 drafts (its length is not moved)."""
        run = self.one_call_forward() if self.one_call else None
        return None if run is None else run.greedy_chain(ids, k, cache, real)

    # --- protocol ----------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def num_layers(self) -> int:
        return self.args.num_hidden_layers

    @property
    def max_len(self) -> int:
        return self.args.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        a = self.args
        return KVCache(a.num_hidden_layers, batch_size, a.num_key_value_heads, a.head_dim,
                       max_len or a.max_position_embeddings, self.cache_dtype or self.dtype, self.device,
                       windows=[a.layer_window(i) for i in range(a.num_hidden_layers)])

    def forward(self, input_ids: torch.Tensor, cache: KVCache, *, tree_mask: torch.Tensor | None = None,
                position_offsets: torch.Tensor | None = None, layers: Sequence[int] | None = None,
                last_only: bool = False, row_tokens: Sequence[int] | None = None) -> torch.Tensor:
        """Logits [B, T, V] (or [B, 1, V] with last_only) for T new tokens per row after each row's cache.

        input_ids [B, T]; tree_mask [T, T] bool (node i sees node j) for a flattened tree, whose
        position_offsets [T] are node depths; layers: the subset of layers to run (layer-skip drafting);
        row_tokens [B]: row b's first row_tokens[b] tokens are real, the rest padding (ModelCapabilities.ragged_rows:
        the C++ layer loop and the output layer skip it; its logits are 0).
        Writes K/V at each row's [length, length + T) without moving the length (see KVCache).
        """
        if self.one_call and tree_mask is None and position_offsets is None and layers is None and row_tokens is None:
            run = self.one_call_forward()
            if run is not None:
                return run(input_ids, cache, last_only)
        return self.forward_hidden(input_ids, cache, tree_mask=tree_mask, position_offsets=position_offsets,
                                   layers=layers, last_only=last_only, row_tokens=row_tokens).logits

    def forward_argmax(self, input_ids: torch.Tensor, cache: KVCache, *, tree_mask: torch.Tensor | None = None,
                       position_offsets: torch.Tensor | None = None, layers: Sequence[int] | None = None,
                       last_only: bool = False, row_tokens: Sequence[int] | None = None) -> torch.Tensor:
        """forward()'s logits' argmax [B, T] long (ModelCapabilities.argmax_head): a quantized output layer
        reduces its rows in the kernel (quant/linear.QuantizedLinear.argmax), no [B, T, V] written."""
        if self.one_call and tree_mask is None and position_offsets is None and layers is None and row_tokens is None:
            return self.forward(input_ids, cache, last_only=last_only).argmax(-1)   # the one call's rounding
        return self.forward_hidden(input_ids, cache, tree_mask=tree_mask, position_offsets=position_offsets,
                                   layers=layers, last_only=last_only, argmax=True, row_tokens=row_tokens).argmax

    def forward_hidden(self, input_ids: torch.Tensor, cache: KVCache, *, tree_mask: torch.Tensor | None = None,
                       position_offsets: torch.Tensor | None = None, layers: Sequence[int] | None = None,
                       last_only: bool = False, hidden_all: bool = False, argmax: bool = False,
                       row_tokens: Sequence[int] | None = None) -> "Scored":
        """forward(), also returning the last hidden state after the final norm (what EAGLE heads read).
        hidden_all: with last_only, the hidden state of every position [B, T, hid] (logits still [B, 1, V]).
        argmax: Scored.argmax instead of the logits (forward_argmax). row_tokens: as forward's (a padding
        position's hidden state is not its token's; its logits are 0, its argmax 0)."""
        if not torch.is_inference_mode_enabled():   # entering the mode costs more than a small layer
            with torch.inference_mode():
                return self.forward_hidden(input_ids, cache, tree_mask=tree_mask,
                                           position_offsets=position_offsets, layers=layers, last_only=last_only,
                                           hidden_all=hidden_all, argmax=argmax, row_tokens=row_tokens)
        B, T = input_ids.shape
        widths = None
        if row_tokens is not None:
            widths = [int(n) for n in row_tokens]
            if len(widths) != B or any(not 0 <= n <= T for n in widths):
                raise ValueError(f"row_tokens must be {B} counts in [0, {T}], got {widths}")
            if last_only:
                raise ValueError("row_tokens with last_only: a ragged row's last real token is not at T - 1")
            if tree_mask is not None or all(n == T for n in widths):
                widths = None
        if T > RING_BLOCK and any(getattr(cache, "rings", ())):
            return self._forward_in_chunks(input_ids, cache, tree_mask, position_offsets, layers, last_only, hidden_all)
        cache.check_room(T, B)
        lens = cache.lengths[:B]
        offs = position_offsets if position_offsets is not None else self.positions[:T]
        if B == 1:
            pos = (offs + lens[0]).unsqueeze(0)                     # [1, T]
        else:
            pos = torch.tensor(lens, device=input_ids.device).unsqueeze(1) + offs   # [B, T]
        # the last position, on the host when the offsets are 0..T-1 (a tensor max costs ~0.2 ms per forward here)
        last = max(lens) + T - 1 if position_offsets is None else int(pos.max())
        if last >= self.args.max_position_embeddings:
            raise ValueError(f"position {last} beyond max_position_embeddings={self.args.max_position_embeddings}")
        cis = self.rope_cis[pos].unsqueeze(2)                      # [B, T, 1, D/2]
        a = self.args
        cis_local = self.rope_cis_local[pos].unsqueeze(2) if self.rope_cis_local is not None else None
        cis_of = [cis if a.layer_theta(i) == a.rope_theta else cis_local for i in range(a.num_hidden_layers)]
        kv_len = max(lens) + T
        windows = [a.layer_window(i) for i in range(a.num_hidden_layers)]
        masks = {w: self._mask(lens, T, kv_len, tree_mask, pos, offs, input_ids.device, w) for w in set(windows)}
        rings = getattr(cache, "rings", None) or [0] * a.num_hidden_layers
        # a ring layer past its ring: each row's last `ring` slots, gathered in order, and their mask
        wrapped = {(w, r): self._ring_slots(lens, T, r, kv_len, tree_mask, pos, offs, input_ids.device, w)
                   for w, r in zip(windows, rings) if r and kv_len > r}
        act = ACTIVATIONS[a.hidden_act]
        H, Hkv, D, hid, eps = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.hidden_size, a.rms_norm_eps
        gqa = {"enable_gqa": True} if (Hkv != H and _HAS_GQA) else {}
        if a.attn_scale is not None:
            gqa["scale"] = a.attn_scale
        rep = H // Hkv if (Hkv != H and not _HAS_GQA) else 1
        fast = self.layer_weights()
        if self._norms is None:
            self._norms = (FastRMSNorm(hid, eps, self.device), FastRMSNorm(D, eps, self.device))
        norm, head_norm = self._norms
        inter = a.intermediate_size
        x = self.embed(input_ids)                                  # [B, T, hid]
        if a.embed_scale is not None:                              # in the model's dtype, as transformers does
            x = x * torch.tensor(a.embed_scale, dtype=self.dtype).to(x.dtype)
        # the C++ layer loop applies each layer's window itself (quant/fused.py): it takes the full-attention mask
        fused = self.fused_layers() if cache.dtype == torch.float32 else None
        run = range(len(fast)) if layers is None else layers
        if fused is not None:
            x = fused(x, cache, pos, self._mask(lens, T, kv_len, tree_mask, pos, offs, input_ids.device, None), run,
                      kv_len, widths)
            run = ()
        for i in run:
            w = fast[i]
            h = norm(x, w.ln1)
            qkv = _linear(h, w.qkv, w.qkv_bias).view(B, T, H + 2 * Hkv, D)
            qk, v = qkv.narrow(2, 0, H + Hkv), qkv.narrow(2, H + Hkv, Hkv)   # [B, T, H+Hkv | Hkv, D]
            if w.q_norm is not None:
                q, k = qk.narrow(2, 0, H), qk.narrow(2, H, Hkv)
                qk = torch.cat([head_norm(q, w.q_norm), head_norm(k, w.k_norm)], 2)
            qk = apply_rope(qk, cis_of[i]).transpose(1, 2)               # [B, H+Hkv, T, D]
            q, k = qk.narrow(1, 0, H), qk.narrow(1, H, Hkv)        # [B, H|Hkv, T, D]
            cache.write(i, k, v.transpose(1, 2))
            ring = wrapped.get((windows[i], rings[i]))
            if ring is None:
                keys = cache.k[i].narrow(0, 0, B).narrow(2, 0, kv_len)  # [B, Hkv, S, D]
                vals = cache.v[i].narrow(0, 0, B).narrow(2, 0, kv_len)
                mask = masks[windows[i]]
            else:
                idx, mask = ring                                   # [B, Hkv, ring, D] gather index, [B, 1, T, ring]
                keys = torch.gather(cache.k[i].narrow(0, 0, B), 2, idx)
                vals = torch.gather(cache.v[i].narrow(0, 0, B), 2, idx)
            if keys.dtype != q.dtype:                              # a --kv-cache-dtype other than the weights'
                keys, vals = keys.to(q.dtype), vals.to(q.dtype)
            if rep > 1:
                keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
            y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, **gqa)   # [B, H, T, D]
            y = _linear(y.transpose(1, 2).reshape(B, T, H * D), w.o, w.o_bias)   # [B, T, hid]
            x = x + (y if w.post_attn is None else norm(y, w.post_attn))
            h = norm(x, w.ln2)
            gu = _linear(h, w.gate_up, w.gate_up_bias)             # [B, T, 2 inter]
            y = _linear(act(gu.narrow(-1, 0, inter)) * gu.narrow(-1, inter, inter), w.down, w.down_bias)
            x = x + (y if w.post_mlp is None else norm(y, w.post_mlp))
        if last_only and not hidden_all:
            x = x[:, -1:]
        h = norm(x, self.norm.weight)                              # [B, T, hid]
        head = self.quantized.get("lm_head.weight", self.lm_head.weight)
        hs = h[:, -1:].contiguous() if last_only else h                              # [B, T | 1, hid]
        real = None
        if widths is not None:     # the output layer over the real positions alone: [n real, hid]
            real = torch.tensor([b * T + t for b, n in enumerate(widths) for t in range(n)], dtype=torch.long)
            hs = hs.reshape(B * T, -1).index_select(0, real)
        if argmax:             # a quantized head reduces each row in its kernel: no [B, T, V] logits written
            ids = F.linear(hs, head).argmax(-1) if isinstance(head, torch.Tensor) else head.argmax(hs)
            if real is not None:
                ids = ids.new_zeros(B * T).index_copy_(0, real, ids).view(B, T)
            return Scored(None, h, ids)                                              # argmax [B, T | 1]
        logits = _linear(hs, head)
        if real is not None:
            logits = logits.new_zeros(B * T, logits.shape[-1]).index_copy_(0, real, logits).view(B, T, -1)
        return Scored(logits, h)                                                     # logits [B, T | 1, V]

    def _forward_in_chunks(self, input_ids, cache, tree_mask, position_offsets, layers, last_only, hidden_all):
        """A chain longer than RING_BLOCK over a cache with ring layers (cache/kv_cache.py): chunks of at most
        RING_BLOCK tokens, each written before the next; the rows' lengths are where they were afterwards."""
        if tree_mask is not None or position_offsets is not None:
            raise ValueError(f"a tree block over a sliding-window cache holds at most {RING_BLOCK} tokens")
        B, T = input_ids.shape
        start = list(cache.lengths[:B])
        outs = []
        try:
            for c0 in range(0, T, RING_BLOCK):
                c1 = min(T, c0 + RING_BLOCK)
                outs.append(self.forward_hidden(input_ids[:, c0:c1], cache, layers=layers, last_only=last_only,
                                                hidden_all=hidden_all))
                if c1 < T:
                    for b in range(B):
                        cache.lengths[b] += c1 - c0
        finally:
            cache.lengths[:B] = start
        for b in range(B):
            cache.written[b] = start[b] + T
        if last_only:
            hid = torch.cat([o.hidden for o in outs], 1) if hidden_all else outs[-1].hidden
            return Scored(outs[-1].logits, hid)
        return Scored(torch.cat([o.logits for o in outs], 1), torch.cat([o.hidden for o in outs], 1))

    def _ring_slots(self, lens, T, ring, kv_len, tree_mask, pos, offs, device, sw):
        """For a ring layer once some row passed its ring: each row's last `ring` slots in order (cache slot j at
        j % ring) as a gather index [B, Hkv, ring, D], and the mask [B, 1, T, ring] over them."""
        B = len(lens)
        a = self.args
        ends = torch.tensor(lens, device=device).view(B, 1) + T                 # [B, 1]
        slots = ends - ring + torch.arange(ring, device=device).view(1, ring)   # [B, ring] logical slots, < 0: none
        mask = self._mask(lens, T, kv_len, tree_mask, pos, offs, device, sw, slots=slots)
        idx = (slots.clamp(min=0) % ring).view(B, 1, ring, 1).expand(B, a.num_key_value_heads, ring, a.head_dim)
        return idx, mask

    def _mask(self, lens, T, kv_len, tree_mask, pos, offs, device, sw: int | None, slots=None):
        """Boolean attention mask [B, 1, T, S] (True = attend) for a layer with sliding window sw (None: full),
        or None when plain causal decoding of one token per row of equal length needs none. slots [B, S]: the
        logical cache slots the keys are (a ring layer's; negative: none), default 0 .. kv_len - 1."""
        if slots is None and T == 1 and tree_mask is None and len(set(lens)) == 1 and (sw is None or kv_len <= sw):
            return None
        B = len(lens)
        j = torch.arange(kv_len, device=device).view(1, 1, -1) if slots is None else slots.unsqueeze(1)   # [1|B, 1, S]
        kv_len = j.shape[-1]                                       # key slots
        L = torch.tensor(lens, device=device).view(B, 1, 1)        # [B, 1, 1]
        rel = j - L                                                # [B, 1, S] slot relative to new block
        new = (rel >= 0) & (rel < T)
        if tree_mask is None:
            within = rel <= torch.arange(T, device=device).view(1, T, 1)   # causal among new tokens
        else:
            idx = rel.clamp(0, T - 1).expand(B, T, kv_len)
            within = torch.gather(tree_mask.unsqueeze(0).expand(B, T, T), 2, idx)
        m = (rel < 0) | (new & within)                             # [B, T, S]
        if sw is not None:
            key_pos = torch.where(rel < 0, j, L + offs[rel.clamp(0, T - 1)])   # [B, 1, S]
            m = m & (pos.view(B, T, 1) - key_pos < sw)
        if slots is not None:
            m = m & (j >= 0)
        return m.unsqueeze(1)


def meta_model(a: LlamaArgs) -> "LlamaForCausalLM":
    """The module with every parameter on the meta device, for a loader to assign real tensors to. Parameter
    initialisation is skipped: on meta it computes nothing, yet nn.Embedding's normal_ there imports torch's
    compiler stack (seconds of start-up)."""
    saved = nn.Embedding.reset_parameters, nn.Linear.reset_parameters
    nn.Embedding.reset_parameters = nn.Linear.reset_parameters = lambda self: None
    try:
        with torch.device("meta"):
            return LlamaForCausalLM(a)
    finally:
        nn.Embedding.reset_parameters, nn.Linear.reset_parameters = saved

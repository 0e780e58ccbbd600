"""The native model's arguments (LlamaArgs: a family's description resolved against one config), its
activations and RoPE frequencies, and the q/k row layout it computes in."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # {"rope_type": "llama3" | "linear" | "dynamic" | "yarn" | "default", ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False         # bias on q/k/v (qwen2 always; llama and qwen3 with attention_bias)
    o_bias: bool = False                 # bias on the output projection (llama and qwen3 with attention_bias)
    mlp_bias: bool = False               # bias on gate/up/down (llama mlp_bias)
    hidden_act: str = "silu"             # a key of ACTIVATIONS
    qk_norm: bool = False                # qwen3: RMSNorm on each head's q and k
    sliding_window: int | None = None    # mistral, qwen2/qwen3 with use_sliding_window
    window_layers: list[bool] | None = None   # which layers use sliding_window (None: all of them)
    model_type: str = "llama"
    # what Gemma 3 adds (models/arch/gemma3.py); the defaults are Llama's
    post_norms: bool = False             # RMSNorm on the attention and MLP outputs before each residual add
    embed_scale: float | None = None     # embeddings times this (sqrt(hidden)), rounded to the model's dtype
    attn_scale: float | None = None      # attention scale (None: head_dim ** -0.5)
    layer_rope_theta: list[float] | None = None   # RoPE base per layer (None: rope_theta on every layer)
    norm_offset: float = 0.0             # the family's norms compute x * (norm_offset + w): already added to the
                                         # norm weights the model holds (the loaders add it once), for reference
    eos_token_id: list[int] = field(default_factory=list)
    hf_config: dict | None = field(default=None, repr=False)   # for rope types computed by transformers' own code

    def layer_theta(self, i: int) -> float:
        """The RoPE base of layer i; layers at rope_theta use rope_scaling, others plain RoPE."""
        return self.rope_theta if self.layer_rope_theta is None else self.layer_rope_theta[i]

    def layer_window(self, i: int) -> int | None:
        if self.sliding_window is None or (self.window_layers is not None and not self.window_layers[i]):
            return None
        return self.sliding_window


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# hidden_act names (transformers' ACT2FN keys) the native MLP implements; any other goes to the fallback
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": _gelu_tanh,
               "gelu_new": _gelu_tanh, "relu": F.relu}
# rope types computed here (default, linear, llama3) or by transformers' own init function (dynamic: equal to
# default up to max_position_embeddings, which positions never pass here; yarn: frequencies and a scale)
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")


def rope_kind(rs: dict | None) -> str:
    rs = rs or {}
    return rs.get("rope_type", rs.get("type", "default")) or "default"


def rope_inv_freq(a: LlamaArgs, theta: float | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], the scale of cos/sin) for the config's rope type; theta other than
    rope_theta: plain RoPE with that base (Gemma 3's sliding layers)."""
    local = theta is not None and theta != a.rope_theta
    base = theta if local else a.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, a.head_dim, 2, dtype=torch.float64) / a.head_dim))
    rs = {} if local else (a.rope_scaling or {})
    kind = rope_kind(rs)
    if kind in ("dynamic", "yarn"):
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, scale = ROPE_INIT_FUNCTIONS[kind](AutoConfig.for_model(**(a.hf_config or {})), None)
        return inv.float(), float(scale)
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl >= hi_wl) & (wl <= lo_wl)
        inv = torch.where(is_mid, mid, scaled)
    elif kind != "default":
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    return inv.float(), 1.0


def interleave_rope_rows(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder q/k projection rows (or bias, or q/k-norm weight) of each head from Hugging Face's
    rotate-half layout [x_0..x_{D/2-1}, y_0..y_{D/2-1}] to pairs [x_0, y_0, x_1, y_1, ...]. q.k is unchanged
    (q and k get the same permutation); only the cache's key layout is ours."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)   # [D]
    shape = w.shape
    return w.reshape(n_heads, head_dim, *shape[1:])[:, perm].reshape(shape)

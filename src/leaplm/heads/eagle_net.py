"""An EAGLE-style draft head: one decoder layer predicting the target's next feature.

Input at position t: the target's feature f_t (its last hidden state after the final norm, what lm_head
reads) and the embedding of token t+1, fused by fc([e_{t+1} ; f_t]) (EAGLE-1's order and vLLM's). The layer
is a Llama decoder layer without its input norm (as EAGLE); its output is the predicted f_{t+1}, and the
target's own lm_head turns it into the draft's logits for token t+2. Drafting further feeds predicted features
back in. The target's embedding and lm_head are reused, not copied (they are not trained here).

Reduced draft vocabulary (EAGLE-3's, draft_vocab_size N): the head then has its own output layer lm_head
[N, hid] over the N target tokens the target emits most, with the maps Speculators and vLLM store (heads/vocab.py):
d2t [N] int64 offsets (target id = draft id + d2t[draft id]) and t2d [V] bool (the target ids kept). On a
49152-token target the full lm_head would cost a fifth of a target forward at every draft depth.

Weights use Hugging Face names (q_proj, gate_proj, ...) and its rotate-half RoPE layout, so the Speculators
and EAGLE layouts (heads/formats.py) are renamings.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.llama import LlamaArgs, rope_inv_freq


@dataclass
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    fusion_bias: bool = False        # a bias on fc (the original EAGLE checkpoints have one; vLLM's EAGLE-1 not)
    draft_vocab_size: int | None = None   # N: the head's own lm_head over N target tokens (None: the target's)

    @classmethod
    def for_target(cls, a: LlamaArgs, intermediate_size: int | None = None,
                   draft_vocab_size: int | None = None) -> "EagleConfig":
        """A head shaped like one of the target's layers (hidden size, heads and RoPE must match its features)."""
        return cls(a.hidden_size, intermediate_size or a.intermediate_size, a.num_attention_heads,
                   a.num_key_value_heads, a.head_dim, a.vocab_size, a.rms_norm_eps, a.rope_theta,
                   a.max_position_embeddings, draft_vocab_size=draft_vocab_size)

    def to_dict(self) -> dict:
        return asdict(self)


class EagleNet(nn.Module):
    """The trainable part of the head (fc + one layer). Embedding and lm_head are the target's, passed in."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.config = c
        H, Hkv, D, hid = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
        self.fc = nn.Linear(2 * hid, hid, bias=c.fusion_bias)
        self.q_proj = nn.Linear(hid, H * D, bias=False)
        self.k_proj = nn.Linear(hid, Hkv * D, bias=False)
        self.v_proj = nn.Linear(hid, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, hid, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(hid, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(hid, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hid, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, hid, bias=False)
        if c.draft_vocab_size is not None:
            N = c.draft_vocab_size
            self.lm_head = nn.Linear(hid, N, bias=False)
            self.register_buffer("d2t", torch.zeros(N, dtype=torch.long))                 # [N] offsets
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))      # [V]
        args = LlamaArgs(c.vocab_size, hid, c.intermediate_size, 1, H, Hkv, D, c.max_position_embeddings,
                         rope_theta=c.rope_theta)
        inv, scale = rope_inv_freq(args)                                             # [D/2], cos/sin scale
        ang = torch.outer(torch.arange(c.max_position_embeddings, dtype=torch.float32), inv)   # [P, D/2]
        self.register_buffer("cos", scale * torch.cat([ang.cos(), ang.cos()], -1), persistent=False)   # [P, D]
        self.register_buffer("sin", scale * torch.cat([ang.sin(), ang.sin()], -1), persistent=False)

    def draft_ids(self) -> torch.Tensor | None:
        """[N] the target id of each draft-vocabulary row (None: the head drafts over the whole vocabulary)."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.config.draft_vocab_size) + self.d2t

    # --- pieces, so training can lay out keys of several unrolled passes --------------------------------------
    def fuse(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """emb [..., hid] (embedding of token t+1), feat [..., hid] (feature f_t) -> layer input [..., hid]."""
        return self.fc(torch.cat([emb, feat], -1))

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """x [B, T, hid], pos [B, T] long -> q [B, H, T, D], k and v [B, Hkv, T, D] (RoPE applied)."""
        c = self.config
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.cos[pos].unsqueeze(1).to(x.dtype), self.sin[pos].unsqueeze(1).to(x.dtype)   # [B, 1, T, D]
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q over keys/vals [B, Hkv, S, D] (mask [T, S] or [B, 1, T, S] bool, True = attend),
        then the residual MLP. x [B, T, hid] the layer input -> the predicted features [B, T, hid]."""
        c = self.config
        B, T, _ = x.shape
        gqa = c.num_key_value_heads != c.num_attention_heads
        y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=gqa)   # [B, H, T, D]
        h = x + self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        g = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(g)) * self.up_proj(g))

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Causal pass over whole sequences: emb, feat [B, T, hid]; pos [B, T] -> predicted features [B, T, hid]."""
        x = self.fuse(emb, feat)
        q, k, v = self.qkv(x, pos)
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        return self.finish(x, q, k, v, causal)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face's layout): x [B, h, T, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin

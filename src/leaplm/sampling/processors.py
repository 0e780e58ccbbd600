"""From raw logits to the processed distribution a request samples from.

Order (as Hugging Face applies them): repetition penalty, temperature, top-k, top-p, min-p, softmax. The
same processor turns target logits into p and draft logits into q, one row per position; the repetition
penalty of row i counts the tokens before it, draft tokens of the same step included (block_presence), so
p at every verified position is exactly what plain decoding would have used there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams
from .categorical import sample_categorical


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def block_presence(base: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Token-presence rows for a block of positions: row i = base plus drafts[:i].

    base [V] bool (prompt + committed tokens); drafts [K] long -> [K + 1, V] bool.
    """
    K = drafts.numel()
    rows = base.unsqueeze(0).repeat(K + 1, 1)                       # [K+1, V]
    for j, t in enumerate(drafts.tolist()):                         # draft j is context for rows j+1..K
        rows[j + 1 :, t] = True
    return rows


def tree_presence(base: torch.Tensor, nodes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-presence rows for a tree block: row r = base plus the tokens on the path root..r.

    base [V] bool; nodes [K] long; mask [K + 1, K + 1] bool (cache/tree.py) -> [K + 1, V] bool.
    """
    onehot = torch.nn.functional.one_hot(nodes, base.numel()).float()   # [K, V]
    seen = mask[:, 1:].float() @ onehot                                 # [K+1, V] ancestors' tokens (and own)
    return base.unsqueeze(0) | (seen > 0)


@dataclass
class LogitsProcessor:
    params: SamplingParams

    @property
    def uses_presence(self) -> bool:
        return self.params.repetition_penalty != 1.0

    def penalize(self, logits: torch.Tensor, presence: torch.Tensor | None) -> torch.Tensor:
        """logits [N, V] float; presence [N, V] bool or None."""
        r = self.params.repetition_penalty
        if r == 1.0 or presence is None:
            return logits
        pen = torch.where(logits < 0, logits * r, logits / r)
        return torch.where(presence, pen, logits)

    def shifted(self, logits: torch.Tensor, presence: torch.Tensor | None = None) -> torch.Tensor:
        """The penalised logits [N, V] float64 minus their row maximum: <= 0, the maximum exactly 0, never NaN.

        Exact for every accepted repetition penalty: when l / r overflows (r below ~1e-306) the row's maximum is
        infinite, and then only the boosted tokens (seen, l > 0) can have mass, at (l - l_max) / r."""
        x = logits.double()                                                            # [N, V]
        r = self.params.repetition_penalty
        if r == 1.0 or presence is None:
            return x - x.max(-1, keepdim=True).values
        xp = torch.where(presence, torch.where(x < 0, x * r, x / r), x)
        m = xp.max(-1, keepdim=True).values                                            # [N, 1]
        over = torch.isinf(m)
        if not bool(over.any()):
            return xp - m
        boosted = presence & (x > 0)
        lm = torch.where(boosted, x, float("-inf")).max(-1, keepdim=True).values
        alt = torch.where(boosted, (x - lm) / r, float("-inf"))
        return torch.where(over, alt, xp - m)

    def greedy(self, logits: torch.Tensor, presence: torch.Tensor | None = None) -> torch.Tensor:
        """Argmax tokens [N] of the penalised logits [N, V] (top-k/p and min-p never remove the argmax)."""
        if self.params.repetition_penalty == 1.0 or presence is None:
            return logits.argmax(-1)
        return self.shifted(logits, presence).argmax(-1)

    def probs(self, logits: torch.Tensor, presence: torch.Tensor | None = None) -> torch.Tensor:
        """Processed distribution [N, V] float32 from logits [N, V]; requires a temperature the params do not
        call greedy. Computed in float64 on logits shifted to a row maximum of 0, so no parameter value in the
        accepted ranges overflows: the top token always keeps its mass (never NaN, never all zero)."""
        sp = self.params
        x = self.shifted(logits, presence) / sp.temperature                           # [N, V] <= 0, max 0
        if sp.top_k and sp.top_k < x.shape[-1]:
            kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]    # [N, 1]
            x = x.masked_fill(x < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_x, idx = torch.sort(x, dim=-1, descending=True)
            sp_probs = sorted_x.softmax(-1)
            # keep a token while the mass strictly before it is < top_p (the top token always stays)
            drop_sorted = (sp_probs.cumsum(-1) - sp_probs) >= sp.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        probs = x.softmax(-1)
        if sp.min_p > 0.0:
            keep = probs >= sp.min_p * probs.max(-1, keepdim=True).values
            probs = probs * keep
            probs = probs / probs.sum(-1, keepdim=True)
        return probs.float()

    @staticmethod
    def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One token per row of probs [N, V] -> [N] long."""
        return sample_categorical(probs, generator).view(-1)

"""Medusa-1 heads on the frozen target: head i maps the target's feature f_t (last hidden state after the final
norm) through one residual SiLU block to a feature whose lm_head logits predict the token i + 2 places after t
(the target's own logits predict the one right after). The target's lm_head is shared by every head (the
original gives each head its own copy; on a CPU one projection of vocabulary size per head is the cost that
matters, and sharing it keeps the heads a few hundred kB)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4

    def to_dict(self) -> dict:
        return asdict(self)


class MedusaNet(nn.Module):
    def __init__(self, c: MedusaConfig):
        super().__init__()
        self.config = c
        self.heads = nn.ModuleList(nn.Linear(c.hidden_size, c.hidden_size) for _ in range(c.num_heads))
        for h in self.heads:                       # start as the identity: head i first guesses what f_t says
            nn.init.zeros_(h.weight)
            nn.init.zeros_(h.bias)

    def forward(self, feat: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """feat [..., hid] -> per-head features [n, ..., hid] of the first n heads (default: all)."""
        return torch.stack([feat + F.silu(h(feat)) for h in self.heads[:n]])

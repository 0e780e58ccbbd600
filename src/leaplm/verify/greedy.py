"""Greedy verification: accept while the draft equals the target's argmax, then the target's own token."""
from __future__ import annotations

import torch

from .result import VerifyResult


def verify_greedy(draft: torch.Tensor, target_argmax: torch.Tensor) -> VerifyResult:
    """draft [K] long; target_argmax [K + 1] long (argmax of processed p at each verified position)."""
    tgt = target_argmax.tolist()                                   # one host sync per step
    d = draft.tolist() if draft.numel() else []
    n = 0
    while n < len(d) and d[n] == tgt[n]:
        n += 1
    return VerifyResult(tokens=tgt[: n + 1], accepted=n)           # tgt[:n] == d[:n]

"""Greedy verification: accept while the draft equals the target's argmax, then the target's own token."""
from __future__ import annotations

import torch

from .result import VerifyResult


def verify_greedy(draft: torch.Tensor, target_argmax: torch.Tensor) -> VerifyResult:
    """draft [K] long; target_argmax [K + 1] long (argmax of processed p at each verified position)."""
    K = draft.numel()
    agree = (draft == target_argmax[:K]).int()                     # [K]
    n = int(agree.cumprod(0).sum()) if K else 0
    tgt = target_argmax.tolist()
    return VerifyResult(tokens=tgt[: n + 1], accepted=n)           # tgt[:n] == draft[:n]

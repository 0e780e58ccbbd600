"""Exact speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Draft token x_i (sampled from q_i) is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection the recovered token is sampled from residual(p_i, q_i) = normalize(max(0, p_i - q_i)); if all K are
accepted a bonus token is sampled from p_K. Then every emitted token is distributed exactly as sampling
from p alone. A deterministic proposer (q = None) is a one-hot q: accept with probability p_i(x_i), and the
residual is p_i with x_i removed.
"""
from __future__ import annotations

import torch

from ..sampling.categorical import sample_categorical
from .result import VerifyResult


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) for p, q [V]; p itself when the difference has no mass (then p == q, which
    cannot reach here since p(x)/q(x) = 1 accepts)."""
    r = (p - q).clamp_min(0)
    s = r.sum()
    return r / s if s > 0 else p


def verify_rejection(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                     generator: torch.Generator) -> VerifyResult:
    """draft [K] long; q [K, V] float or None (one-hot at draft); p [K + 1, V] float; one generator per request."""
    K = draft.numel()
    emitted: list[int] = []
    if K:
        idx = draft.view(K, 1)
        p_x = p[:K].gather(1, idx).view(K)                          # [K]
        q_x = q.gather(1, idx).view(K) if q is not None else torch.ones_like(p_x)
        u = torch.rand(K, generator=generator, device=p.device)      # [K]
        ok = (u * q_x < p_x).int()                                  # u < p/q without dividing by q = 0
        n = int(ok.cumprod(0).sum())
        emitted = draft[:n].tolist()
        if n < K:
            if q is not None:
                r = residual(p[n], q[n])
            else:
                r = p[n].clone()
                r[draft[n]] = 0
                r = r / r.sum() if r.sum() > 0 else p[n]
            emitted.append(int(sample_categorical(r, generator)))
            return VerifyResult(tokens=emitted, accepted=n)
    emitted.append(int(sample_categorical(p[K], generator)))
    return VerifyResult(tokens=emitted, accepted=K)

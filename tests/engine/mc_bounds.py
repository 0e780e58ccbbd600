"""The Monte Carlo bound shared by the engine's distribution tests.

Cells with exact probability below MIN_CELL are pooled into one; with k cells and n samples the total variation
between the empirical and the exact distribution exceeds sqrt((k ln 2 + ln(1/DELTA)) / (2n)) with probability
below DELTA (Weissman et al. 2003), so a correct sampler fails by chance less than once in a million runs.
"""
from __future__ import annotations

import math

import torch

DELTA = 1e-6
MIN_CELL = 0.01


def tv_and_bound(empirical: torch.Tensor, exact: torch.Tensor, n: int) -> tuple[float, float]:
    """Total variation over the cells fixed by `exact`, and the DELTA-level bound for n samples."""
    keep = exact.flatten() >= MIN_CELL
    e, x = empirical.flatten(), exact.flatten()
    cells_e = torch.cat([e[keep], e[~keep].sum().view(1)])
    cells_x = torch.cat([x[keep], x[~keep].sum().view(1)])
    k = int(keep.sum()) + 1
    tv = 0.5 * float((cells_e - cells_x).abs().sum())
    return tv, math.sqrt((k * math.log(2) + math.log(1 / DELTA)) / (2 * n))

"""Tree verification: walk from the root, at each node trying its children as candidates for the next token.

Greedy: follow the child equal to the target's argmax; stop at the first node with none and emit the argmax.

Sampling (multi-candidate rejection sampling, as SpecInfer): at a node whose target distribution is p, try
the children x_1, x_2, ... in order with a running distribution p' (initially p):
  - child sampled from q (q given): accept with probability min(1, p'(x) / q(x)); on rejection
    p' <- residual(p', q) = normalize(max(0, p' - q)). Exact when the children were drawn independently
    from their q rows.
  - deterministic child (q is None, a one-hot q): accept with probability p'(x); on rejection
    p' <- p' with x zeroed, renormalised. Exact for any fixed candidate list, duplicates included.
The first accepted child becomes the node and the walk goes on; if every child is rejected the recovered
token is sampled from p' (from p itself at a leaf: the bonus token). Each emitted token is then distributed
exactly as p at its position, conditioned on the tokens before it.
"""
from __future__ import annotations

import torch

from ..cache.tree import children
from ..sampling.categorical import sample_categorical
from .rejection import residual
from .result import VerifyResult


def verify_tree_greedy(nodes: torch.Tensor, parents: list[int], target_argmax: torch.Tensor) -> VerifyResult:
    """nodes [K] long (topological order); parents [K]; target_argmax [K + 1] long, row 0 = the root."""
    toks = nodes.tolist()
    best = target_argmax.tolist()
    kids = children(parents)
    path: list[int] = []
    row = 0
    while True:
        want = best[row]
        nxt = next((c for c in kids[row] if toks[c] == want), None)
        if nxt is None:
            return VerifyResult(tokens=[toks[c] for c in path] + [want], accepted=len(path), path=path)
        path.append(nxt)
        row = nxt + 1


def verify_tree_rejection(nodes: torch.Tensor, parents: list[int], q: torch.Tensor | None, p: torch.Tensor,
                          generator: torch.Generator) -> VerifyResult:
    """nodes [K] long; q [K, V] (the row each node was sampled from) or None (deterministic nodes);
    p [K + 1, V] the target's processed distributions, row 0 = the root; one generator per request."""
    K = nodes.numel()
    toks = nodes.tolist()
    kids = children(parents)
    u = torch.rand(K, generator=generator, device=p.device).tolist() if K else []   # one uniform per node
    if q is None and K:
        # p at each node's parent row, for the node's token: host floats make the sibling loop cheap
        rows = torch.tensor([par + 1 for par in parents], device=p.device)
        p_x = p[rows, nodes].tolist()                                                # [K]
    path: list[int] = []
    row = 0
    while True:
        if q is None:
            nxt, r = _try_deterministic(kids[row], toks, p_x if K else [], u, p[row])
        else:
            nxt, r = _try_sampled(kids[row], toks, q, u, p[row])
        if nxt is None:
            token = int(sample_categorical(r, generator))
            return VerifyResult(tokens=[toks[c] for c in path] + [token], accepted=len(path), path=path)
        path.append(nxt)
        row = nxt + 1


def _try_deterministic(kids: list[int], toks: list[int], p_x: list[float], u: list[float],
                       p_row: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
    """(accepted child, None) or (None, the distribution to sample the recovered token from)."""
    removed = 0.0                                  # p mass of the tokens already rejected here
    tried: list[int] = []
    for c in kids:
        x = toks[c]
        if x in tried:                             # p'(x) = 0: a repeated candidate is always rejected
            continue
        if u[c] * (1.0 - removed) < p_x[c]:        # u < p'(x) = p(x) / (1 - removed)
            return c, None
        tried.append(x)
        removed += p_x[c]
    if not tried:
        return None, p_row
    r = p_row.clone()                              # [V]
    r[tried] = 0
    s = r.sum()
    return None, (r / s if s > 0 else p_row)


def _try_sampled(kids: list[int], toks: list[int], q: torch.Tensor, u: list[float],
                 p_row: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
    pr = p_row                                     # [V] running p'
    for c in kids:
        x = toks[c]
        if u[c] * float(q[c, x]) < float(pr[x]):   # u < p'(x) / q(x) without dividing by q = 0
            return c, None
        pr = residual(pr, q[c])
    return None, pr

"""Verification for sampled requests by the exponential race (sampling/positional.py).

The target's token at each verified position is its own sample there, argmax p / E with the request's
exponentials for that position; a draft token is accepted exactly when it equals it (a chain: the longest
agreeing prefix, then the target's sample; a tree: the walk follows the child equal to it). What is emitted is
therefore exactly what sampling from p alone with the same exponentials emits, whatever was drafted: lossless,
and reproducible whatever K. q is not needed (the proposer's sample was coupled through the same exponentials).
"""
from __future__ import annotations

import torch

from ..sampling.positional import race
from .greedy import verify_greedy
from .result import VerifyResult
from .tree import verify_tree_greedy


def verify_coupled(draft: torch.Tensor, p: torch.Tensor, seed: int, base: int) -> VerifyResult:
    """draft [K] long; p [K + 1, V] the target's processed distributions; base: the position of the block's
    first generated token (row i of p samples the token at base + i)."""
    K = draft.numel()
    return verify_greedy(draft, race(p, seed, [base + i for i in range(K + 1)]))


def verify_tree_coupled(nodes: torch.Tensor, parents: list[int], p: torch.Tensor, seed: int,
                        base: int) -> VerifyResult:
    """nodes [K] long (topological order); p [K + 1, V], row 0 = the root; row c + 1 samples the token after
    node c, at position base + depth(c)."""
    depth: list[int] = []
    for par in parents:
        depth.append(1 if par < 0 else depth[par] + 1)
    return verify_tree_greedy(nodes, parents, race(p, seed, [base] + [base + d for d in depth]))

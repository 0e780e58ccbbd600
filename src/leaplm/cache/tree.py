"""Tree blocks: which tokens of a flattened tree see which, and at what positions.

A tree block is [last committed token (the root), node 0, ..., node K-1] with nodes in topological order
(parents[i] < i, -1 = the root), optionally followed by A extra tokens that are scored in the same forward
but never verified (lookahead's Jacobi window). Block row r sees the committed cache plus its ancestors and
itself; its position is the committed length plus its depth. Extra tokens see the root and, among
themselves, what their own mask says; no tree node sees an extra token, so the tree's logits are exactly
what a block of the tree alone would give.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeLayout:
    mask: torch.Tensor       # [T, T] bool: row r attends to column c (T = 1 + K + A)
    depths: torch.Tensor     # [T] long: position offsets from the root
    n_tree: int              # 1 + K: rows of the root and the tree nodes (the verified part)


def check_parents(parents: list[int]) -> None:
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"tree parents must be topologically ordered (-1 <= parents[i] < i), "
                             f"got parents[{i}] = {p}")


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each block row: 0 for the root, parent's depth + 1 for node i (row i + 1)."""
    depths = [0]
    for p in parents:
        depths.append(depths[p + 1] + 1)
    return depths


def tree_layout(parents: list[int], extra_mask: torch.Tensor | None = None,
                extra_depths: torch.Tensor | None = None, device: str | torch.device = "cpu") -> TreeLayout:
    """Mask and depths of a block [root, K nodes, A extra tokens].

    parents: K ints; extra_mask [A, A] bool (extra token a sees extra token b); extra_depths [A] long.
    """
    check_parents(parents)
    K = len(parents)
    A = extra_mask.shape[0] if extra_mask is not None else 0
    n = K + 1
    mask = torch.zeros(n + A, n + A, dtype=torch.bool, device=device)     # [T, T]
    mask[0, 0] = True
    for i, p in enumerate(parents):          # a node sees what its parent sees, and itself
        mask[i + 1, :n] = mask[p + 1, :n]
        mask[i + 1, i + 1] = True
    depths = torch.tensor(node_depths(parents), dtype=torch.long, device=device)   # [K+1]
    if A:
        mask[n:, 0] = True                   # the window continues from the root
        mask[n:, n:] = extra_mask
        depths = torch.cat([depths, extra_depths.to(device)])
    return TreeLayout(mask, depths, n)


def children(parents: list[int]) -> list[list[int]]:
    """Node indices under each block row (row 0 = the root, row i + 1 = node i), in proposal order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return kids

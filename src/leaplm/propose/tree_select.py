"""Keeping the K best nodes of a drafted tree (EAGLE-2's and Medusa's selection): nodes carry the cumulative
log q of their path; the kept set is closed under ancestors and sent as a chain when it forms one."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Proposal


@dataclass
class Node:
    """A drafted candidate in a proposer's pool of tree nodes."""
    token: int
    parent: int              # index into the node pool, -1 = the root
    score: float             # cumulative log q along the path
    depth: int               # 1 for the root's children


def select_tree(pool: list[Node], k: int) -> Proposal:
    """The k best nodes by cumulative log q (ancestor-closed), in topological order; a chain when they form one."""
    order = sorted(range(len(pool)), key=lambda j: (-pool[j].score, pool[j].depth, j))
    kept: set[int] = set()
    for j in order:
        if len(kept) == k:
            break
        if pool[j].parent < 0 or pool[j].parent in kept:
            kept.add(j)
    nodes = sorted(kept, key=lambda j: (pool[j].depth, j))
    index = {j: n for n, j in enumerate(nodes)}
    parents = [index[pool[j].parent] if pool[j].parent >= 0 else -1 for j in nodes]
    tokens = torch.tensor([pool[j].token for j in nodes], dtype=torch.long)
    if all(p == i - 1 for i, p in enumerate(parents)):
        return Proposal(tokens)                  # a chain: the batched forward scores it
    return Proposal(tokens, parents=parents)

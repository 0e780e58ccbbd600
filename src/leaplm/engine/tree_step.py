"""Stages 2 and 3 for a tree proposal, one row: build the block, verify the tree from its scored logits.

The block is [last committed token, K tree nodes, A extra tokens] (cache/tree.py gives its mask and
positions). Only the root and the nodes are verified; the extra tokens' logits go back to the proposer.
Commit is the chain's (commit.commit): it compacts the cache along result.path, then advances.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.tree import TreeLayout, tree_layout
from ..propose.base import Proposal
from ..sampling import LogitsProcessor, tree_presence
from ..verify import VerifyResult, verify_tree_coupled, verify_tree_greedy
from .request import Request


@dataclass
class TreeBlock:
    ids: torch.Tensor        # [T] long: root, nodes, extra tokens
    layout: TreeLayout


def tree_block(req: Request, proposal: Proposal) -> TreeBlock:
    nodes = proposal.tokens                                                          # [K]
    extra = proposal.extra
    parts = [torch.tensor([req.tokens[-1]], device=nodes.device), nodes]
    if extra is not None:
        parts.append(extra.tokens)
        layout = tree_layout(proposal.parents, extra.mask, extra.depths, device=nodes.device)
    else:
        layout = tree_layout(proposal.parents, device=nodes.device)
    return TreeBlock(torch.cat(parts), layout)                                       # ids [T]


def verify_tree(req: Request, proposal: Proposal, proc: LogitsProcessor, logits: torch.Tensor,
                layout: TreeLayout) -> VerifyResult:
    """logits [T, V] of the block; rows [0, 1 + K) are the root and the nodes."""
    n = layout.n_tree
    nodes = proposal.tokens                                                          # [K]
    presence = tree_presence(req.presence, nodes, layout.mask[:n, :n]) if req.presence is not None else None
    if req.generator is None:
        return verify_tree_greedy(nodes, proposal.parents, proc.greedy(logits[:n], presence))
    p = proc.probs(logits[:n], presence)                                             # [K+1, V]
    return verify_tree_coupled(nodes, proposal.parents, p, req.seed, len(req.tokens))


def extra_logits(proposal: Proposal | None, logits: torch.Tensor) -> torch.Tensor | None:
    """The rows [A, V] of logits [T, V] that scored proposal.extra, or None."""
    if proposal is None or proposal.extra is None:
        return None
    return logits[proposal.k + 1:]

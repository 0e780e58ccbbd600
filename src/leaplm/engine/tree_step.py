"""Stages 2 and 3 for a tree proposal, one row: build the block, score it with the tree mask, verify the tree.

The block is [last committed token, K tree nodes, A extra tokens] (cache/tree.py gives its mask and
positions). Only the root and the nodes are verified; the extra tokens' logits go back to the proposer.
Commit is the chain's (commit.commit): it compacts the cache along result.path, then advances.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..cache.tree import TreeLayout, tree_layout
from ..propose.base import Proposal
from ..sampling import LogitsProcessor
from ..verify import VerifyResult
from .request import Request
from .scoring import forward
from .verification import verify_tree


@dataclass
class TreeBlock:
    ids: torch.Tensor        # [T] long: root, nodes, extra tokens
    layout: TreeLayout


@dataclass
class ScoredTree:
    result: VerifyResult
    logits: torch.Tensor            # [T, V] the block's
    hidden: torch.Tensor | None     # [T, hid] when the proposer reads the target's features
    score_s: float                  # the tree forward's seconds
    block_len: int                  # T


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


def score_tree(model, cache, req: Request, proposal: Proposal, proc: LogitsProcessor, feats: bool,
               sampled: bool, constrain: Callable | None = None) -> ScoredTree:
    """The tree's own forward over the row's batch-1 cache view (after the batched one, whose slots for this row
    it overwrites), then its verifier. feats: return the target's features too; constrain: the logits [T, V] the
    verifier sees (structured output masks them), the raw ones returned."""
    tb = tree_block(req, proposal)
    t = time.perf_counter()
    out = forward(model, tb.ids.unsqueeze(0), cache, feats, tree_mask=tb.layout.mask, position_offsets=tb.layout.depths)
    logits, hidden = (out.logits[0], out.hidden[0]) if feats else (out[0], None)     # [T, V | hid]
    dt = time.perf_counter() - t
    result = verify_tree(req, proposal, proc, constrain(logits) if constrain is not None else logits, tb.layout,
                         sampled)
    return ScoredTree(result, logits, hidden, dt, tb.ids.numel())


def extra_logits(proposal: Proposal | None, logits: torch.Tensor) -> torch.Tensor | None:
    """The rows [A, V] of logits [T, V] that scored proposal.extra, or None."""
    if proposal is None or proposal.extra is None:
        return None
    return logits[proposal.k + 1:]

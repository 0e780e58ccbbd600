"""Stage 3 of the step: which verifier a request runs, on the target's p at every verified position.

  greedy     temperature 0: a draft token is kept while it equals the target's argmax (verify/greedy.py); where
             nothing else reads the logits, the model returns the argmax alone (verify_argmax)
  rejection  sampled requests without a seed (SamplingParams.verifier 'auto') or asking for it: draft token x is
             kept with probability min(1, p(x) / q(x)) (q one-hot for deterministic proposers), the recovered token
             sampled from normalize(max(0, p - q)), the bonus from p (verify/rejection.py; trees: each node's
             children tried as fixed candidates, verify/tree.py). The most a verifier keeps: 1 - TV(p, q) per token.
  race       seeded requests (and, under 'auto', trees of sampling proposers, whose candidates the race draws):
             a draft token is kept when it equals the target's own sample argmax p / E under the seed's
             per-position exponentials (verify/coupled.py); the output is a function of the seed alone, the same
             whatever K and whatever else is in the batch.

All are lossless. `target_probs` is where the target's logits become p at each verified position (the
repetition penalty counting the drafts before it); whatever constrains p per position belongs there.
"""
from __future__ import annotations

import torch

from ..cache.tree import TreeLayout
from ..config import SamplingParams
from ..propose.base import Proposal
from ..sampling import LogitsProcessor, block_presence, tree_presence
from ..verify import (VerifyResult, verify_coupled, verify_greedy, verify_rejection, verify_tree_coupled,
                      verify_tree_greedy, verify_tree_rejection)
from .request import Request


def request_verifier(params: SamplingParams, default: str = "auto") -> str:
    """'greedy', 'race' or 'rejection': what verifies a request's chains (see the module docstring). default: the
    engine's SpecConfig.verifier, for a request that leaves it to 'auto'."""
    if params.greedy:
        return "greedy"
    chosen = params.verifier if params.verifier != "auto" else default
    if chosen == "auto":
        return "race" if params.seed is not None else "rejection"
    return chosen


def wants_q(req: Request) -> bool:
    """Does the verifier read Proposal.q (proposers build it only then)?"""
    return req.verifier == "rejection"


def target_probs(req: Request, proc: LogitsProcessor, logits: torch.Tensor,
                 presence: torch.Tensor | None) -> torch.Tensor:
    """logits [T, V] of the verified positions -> p [T, V], the distribution plain decoding samples from at each
    (presence [T, V]: the tokens before each position, drafts included, or None)."""
    return proc.probs(logits, presence)


def verify_chain(req: Request, proposal: Proposal | None, proc: LogitsProcessor,
                 logits: torch.Tensor) -> VerifyResult:
    """Verify a chain of drafts (or none) against logits [K+1, V] of the block [last token, drafts...]."""
    device = logits.device
    drafts = proposal.tokens if proposal is not None else torch.empty(0, dtype=torch.long, device=device)  # [K]
    presence = block_presence(req.presence, drafts) if req.presence is not None else None  # [K+1, V]
    if req.verifier == "greedy":
        return verify_greedy(drafts, proc.greedy(logits, presence))
    p = target_probs(req, proc, logits, presence)                                      # [K+1, V]
    if req.verifier == "rejection":
        q = proposal.q if proposal is not None else None                               # [K, V] or None
        return verify_rejection(drafts, q, p, req.generator)
    return verify_coupled(drafts, p, req.seed, len(req.tokens))


def verify_argmax(proposal: Proposal | None, target_argmax: torch.Tensor) -> VerifyResult:
    """Greedy verification of a chain against target_argmax [K+1] long, the target's own argmax at each position
    (scoring asked the model for it alone: the request reads nothing else of its logits, engine/scoring.py)."""
    drafts = proposal.tokens if proposal is not None else target_argmax.new_empty(0)             # [K]
    return verify_greedy(drafts, target_argmax)


def verify_tree(req: Request, proposal: Proposal, proc: LogitsProcessor, logits: torch.Tensor,
                layout: TreeLayout, sampled: bool) -> VerifyResult:
    """logits [T, V] of the tree block; rows [0, 1 + K) are the root and the nodes. sampled: the proposer drew
    the nodes from its q (by the race), rather than fixed candidates."""
    n = layout.n_tree
    nodes = proposal.tokens                                                          # [K]
    presence = tree_presence(req.presence, nodes, layout.mask[:n, :n]) if req.presence is not None else None
    if req.verifier == "greedy":
        return verify_tree_greedy(nodes, proposal.parents, proc.greedy(logits[:n], presence))
    p = target_probs(req, proc, logits[:n], presence)                                # [K+1, V]
    if req.verifier == "rejection" and (req.explicit_verifier or not sampled):
        # every node a fixed candidate (q one-hot): exact whatever drew the candidates
        return verify_tree_rejection(nodes, proposal.parents, None, p, req.generator)
    return verify_tree_coupled(nodes, proposal.parents, p, req.seed, len(req.tokens))

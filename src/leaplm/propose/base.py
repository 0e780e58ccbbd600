"""The Proposer protocol: propose K tokens (with q, or None when deterministic; optionally a tree), then
observe what the verifier made of them. One proposer instance per request, so its state is the request's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import SamplingParams
from ..sampling import LogitsProcessor
from ..sampling.positional import ranked
from ..verify import VerifyResult


@dataclass
class ProposeContext:
    tokens: list[int]                  # prompt + committed output, the last token not yet in the target cache
    k: int                             # how many tokens (tree nodes) to propose at most
    params: SamplingParams
    processor: LogitsProcessor
    generator: torch.Generator | None  # None for greedy requests: no random draws
    presence: torch.Tensor | None      # [V] bool: tokens seen so far (repetition penalty), else None
    target_cache: object | None = None # the request's target KVCache (layer-skip drafts into its free slots)
    seed: int | None = None            # sampling requests: the seed fixing every position's sample, see sample()

    def sample(self, q: torch.Tensor, offset: int, candidate: int = 0) -> int:
        """A draft token from q [V] (or [1, V]) at block offset `offset` (0: the first token after `tokens`),
        coupled with the target's sample there (sampling/positional.py): the token the verifier accepts whenever
        the target would have drawn it. candidate j > 0: the j-th further distinct candidate (tree siblings).
        Proposers sample through here; a draw from `generator` instead is still lossless (any draft is) but is
        never accepted more often than chance."""
        if self.seed is not None:
            return ranked(q, self.seed, len(self.tokens) + offset, candidate + 1)[candidate]
        return int(torch.multinomial(q.reshape(-1), 1, generator=self.generator))


@dataclass
class ExtraTokens:
    """Tokens a tree proposer wants scored in the same target forward but never verified or committed
    (lookahead's Jacobi window). They see the committed context, the root and each other per `mask`; their
    logits come back through observe(..., extra_logits)."""
    tokens: torch.Tensor               # [A] long
    mask: torch.Tensor                 # [A, A] bool: extra token a sees extra token b
    depths: torch.Tensor               # [A] long: position offsets from the root (the last committed token)


@dataclass
class Proposal:
    tokens: torch.Tensor               # [K] long: a chain, or the tree's nodes in topological order
    q: torch.Tensor | None = None      # [K, V] draft distribution each token was sampled from; None = deterministic
    parents: list[int] | None = None   # tree only: parent node index per node, -1 = the last committed token
    extra: ExtraTokens | None = None   # tree only: scored beside the tree, see ExtraTokens
    # seconds of this proposal spent feeding committed tokens the proposer had not seen (a draft model after steps
    # that did not draft), not drafting: the K policy prices that apart (catch-up), not per drafted token
    catchup_s: float = 0.0
    # cheap proposers: how many context tokens agree with the text the proposal was copied from (its n-gram
    # included; a long match is a copying stretch): the K policy keeps acceptance per match length
    match: int | None = None

    @property
    def k(self) -> int:
        return self.tokens.numel()


class Proposer(Protocol):
    name: str
    samples: bool   # True when it samples from q at temperature > 0 (then q is returned)
    # optional `cheap = True`: proposing costs next to nothing (n-gram, suffix), so the step asks for a proposal at
    # the row's cap before choosing K and trims it (a tree: its first K nodes, parents come first)

    def propose(self, ctx: ProposeContext) -> Proposal: ...

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits: torch.Tensor | None = None) -> None:
        """Called after every verification; `result.accepted` draft tokens were kept. extra_logits [A, V]: the
        target's raw logits at proposal.extra's tokens (None when the proposal had none)."""
        ...


class ProposerGroup(Protocol):
    """The proposers of one batch that draft together (the draft model: one forward per draft position for all its
    rows). A proposer in a group has it as `.group`; the batch step calls propose_rows once per step with every
    row of the group that drafts, and a proposer without a group row by row through propose()."""

    def propose_rows(self, proposers: list[Proposer], ctxs: list[ProposeContext]) -> list[Proposal]: ...

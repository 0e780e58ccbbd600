"""The Proposer protocol: propose K tokens (with q, or None when deterministic; optionally a tree), then
observe what the verifier made of them. One proposer instance per request, so its state is the request's.

`Proposer` declares every member the engine step reads; `ProposerBase` gives the optional ones their defaults
(not cheap, no group, no target features, nothing to catch up on, nothing to free), so a proposer states only
what it changes. `ProposerFactory` is what the registry returns per method: one proposer per request, and for
proposers that draft for many rows at once (the draft model) the batch's shared group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..config import SamplingParams
from ..sampling import LogitsProcessor
from ..sampling.categorical import sample_categorical
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
    wants_q: bool = False              # the verifier reads Proposal.q (rejection sampling): return it

    def sample(self, q: torch.Tensor, offset: int, candidate: int = 0) -> int:
        """A draft token from q [V] (or [1, V]) at block offset `offset` (0: the first token after `tokens`),
        coupled with the target's sample there (sampling/positional.py): the token the verifier accepts whenever
        the target would have drawn it. candidate j > 0: the j-th further distinct candidate (tree siblings).
        Proposers sample through here; a draw from `generator` instead is still lossless (any draft is) but is
        never accepted more often than chance."""
        if self.seed is not None:
            return ranked(q, self.seed, len(self.tokens) + offset, candidate + 1)[candidate]
        return int(sample_categorical(q.reshape(-1), self.generator))

    def sample_chain(self, q: torch.Tensor, offset: int) -> int:
        """A chain's draft token from q [V] (or [1, V]) at block offset `offset`: sample() when the race verifies
        it; when rejection sampling does (wants_q), which accepts x ~ q with probability min(1, p(x) / q(x))
        whatever drew it, a draw from `generator`: the same acceptance for about a third of the race's cost (its
        exponentials over the vocabulary, paid at every drafted token)."""
        if self.wants_q and self.generator is not None:
            return int(sample_categorical(q.reshape(-1), self.generator))
        return self.sample(q, offset)


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
    q: torch.Tensor | None = None      # [K, V] draft distribution each token was sampled from, only when ctx.wants_q
                                       # (rejection sampling reads it); None = deterministic, or not asked for
    parents: list[int] | None = None   # tree only: parent node index per node, -1 = the last committed token
    extra: ExtraTokens | None = None   # tree only: scored beside the tree, see ExtraTokens
    # seconds of this proposal spent feeding committed tokens the proposer had not seen (a draft model after steps
    # that did not draft), not drafting: the K policy prices that apart (catch-up), not per drafted token
    catchup_s: float = 0.0
    # cheap proposers: how many context tokens agree with the text the proposal was copied from (its n-gram
    # included; a long match is a copying stretch): the K policy keeps acceptance per match length
    match: int | None = None
    # the drafts are the request's prediction (Predicted Outputs, propose/prediction.py): counted apart in the stats
    predicted: bool = False

    @property
    def k(self) -> int:
        return self.tokens.numel()


class Proposer(Protocol):
    """Every member the engine step reads (ProposerBase has the defaults of the optional ones)."""
    name: str
    samples: bool        # True when it samples from q at temperature > 0 (q returned when ctx.wants_q)
    cheap: bool          # proposing costs next to nothing (n-gram, suffix): the step asks for a proposal at the
                         # row's cap before choosing K and trims it (a tree: its first K nodes, parents come first)
    group: "ProposerGroup | None"   # the batch's group when it drafts together with other rows (the draft model)
    reads_hidden: bool   # it reads the target's features of committed tokens through observe_hidden
    bursty: bool         # its acceptance comes in stretches the last outcome tells (copying proposers: n-gram,
                         # suffix, lookahead): the K policy keeps its estimate in two states (engine/kpolicy/acceptance.py)
    shadows: bool        # guesses() scores its one-token guesses on committed tokens (a draft model), so the K policy
                         # keeps learning while the row decodes plainly (engine/kpolicy/shadow.py)
    reads_target_cache: bool   # propose() reads ctx.target_cache (layer-skip drafts into its free slots); the
                               # others get None, and the step builds no row view for them

    def propose(self, ctx: ProposeContext) -> Proposal: ...

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits: torch.Tensor | None = None) -> None:
        """Called after every verification; `result.accepted` draft tokens were kept. extra_logits [A, V]: the
        target's raw logits at proposal.extra's tokens (None when the proposal had none)."""
        ...

    def observe_hidden(self, start: int, hidden: torch.Tensor) -> None:
        """hidden [m, hid]: the target's last hidden state at committed positions [start, start + m) (only
        called when reads_hidden)."""
        ...

    def lag(self, n_tokens: int) -> int:
        """Committed tokens (of n_tokens) the proposer has not seen yet: what its next proposal must feed first
        (the K policy prices that catching up apart from drafting)."""
        ...

    def guesses(self, tokens: list[int], first: int = 0) -> "Guesses | None":
        """Feed the committed tokens not seen yet (all but the last of `tokens`) teacher-forced, and return the
        proposer's next-token logits after each: what it would have drafted first there (only when shadows).
        Guesses of the tokens before index `first` (a prompt's) are not asked for: those tokens are only fed."""
        ...

    def close(self) -> None:
        """The request left the batch: free what the proposer holds (a group's row)."""
        ...


@dataclass
class Guesses:
    """A proposer's teacher-forced one-token guesses: logits[j] follow tokens[:start + j + 1], a guess of
    tokens[start + j + 1]."""
    start: int
    logits: torch.Tensor               # [m, V] (the target's vocabulary)


class ProposerBase:
    """Defaults of the Proposer protocol's optional members."""
    samples = False
    cheap = False
    group = None
    reads_hidden = False
    bursty = False
    shadows = False
    reads_target_cache = False

    def guesses(self, tokens: list[int], first: int = 0) -> Guesses | None:
        return None

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits: torch.Tensor | None = None) -> None:
        pass

    def observe_hidden(self, start: int, hidden: torch.Tensor) -> None:
        pass

    def lag(self, n_tokens: int) -> int:
        return 0

    def close(self) -> None:
        pass


class ProposerGroup(Protocol):
    """The proposers of one batch that draft together (the draft model: one forward per draft position for all its
    rows). A proposer in a group has it as `.group`; the batch step calls propose_rows once per step with every
    row of the group that drafts, and a proposer without a group row by row through propose()."""

    def propose_rows(self, proposers: list[Proposer], ctxs: list[ProposeContext]) -> list[Proposal]: ...


class ProposerFactory:
    """One proposer per request (`factory(max_len, group)`). new_group: the group a batch shares among the rows of
    this method (None: its proposers draft row by row); forget: drop what proposers remember across requests."""

    def __call__(self, max_len: int, group: ProposerGroup | None = None) -> Proposer:
        raise NotImplementedError

    def new_group(self, max_rows: int, max_len: int) -> ProposerGroup | None:
        return None

    def forget(self) -> None:
        pass


class SimpleFactory(ProposerFactory):
    """A factory from a function of max_len (proposers that draft row by row and remember nothing across
    requests)."""

    def __init__(self, build: Callable[[int], Proposer]):
        self.build = build

    def __call__(self, max_len: int, group: ProposerGroup | None = None) -> Proposer:
        return self.build(max_len)

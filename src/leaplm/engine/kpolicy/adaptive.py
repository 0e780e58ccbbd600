"""The cost model's K: each step's K from measured costs and measured acceptance, down to 0 (no speculation) when
speculating is predicted slower than plain decoding. The measured rates (measured.py) take it as their prior.

The inputs are per row (`RowSpec`: its cap, its acceptance estimate from acceptance.py, its proposer's cost) and
the target's costs per (rows, block length) (costs.py: a level that follows the load times a shape measured
pairwise at start-up); the step's cost is the wide forward only when some row has a proposal. A cheap proposer's
proposal is in hand before K is chosen (`with_proposal`): its length caps the row's K, its match length selects
the acceptance estimate, and its cost is spent whatever K is chosen, so it is not charged.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .acceptance import AcceptanceEstimate, expected_tokens
from .costs import BatchCostModel

# With n rows verified in one forward of n x (K + 1) tokens, the step's K maximises the batch's token rate
#   sum_i (1 + m_i G_i(k_i)) / (E[cost(n, 1 + the longest k_i among rows that have a proposal)]
#                               + sum_i [m_i k_i propose_s_i + catchup_i])
# where k_i = min(K, cap_i), cap_i is row i's own K (0 for a row that does not speculate), m_i how often row i's
# proposer has a proposal, G_i its expected accepted tokens given one, and catchup_i (only for rows that draft)
# a draft model's prefill of unseen tokens spread over the request's remaining steps; K > 0 must beat K = 0 by
# min_gain. As n grows the forward turns compute-bound, cost(n, K + 1) outgrows the tokens it buys and K falls
# to 0: speculation never makes a full batch slower than plain decoding.

NEAR = 0.15               # a K priced within this of the best is close enough for measurement to decide
CATCHUP_BUDGET = 0.02     # an exploration's catching up paid at once: at most this share of the request's rest


@dataclass
class RowSpec:
    """What the batch controller needs to know about one running row."""
    cap: int                       # this row's own K (0: the row does not speculate)
    acceptance: float              # per-token acceptance estimate, given a proposal
    propose_s_per_token: float     # measured proposer seconds per drafted token
    catchup_s: float = 0.0         # a draft model's prefill of tokens it has not seen, spread over the request's
                                   # remaining steps (paid once, then drafting is cheap): charged when it drafts
    extra_tokens: float = 0.0      # tokens its proposals add to the forward beyond K (lookahead's window)
    tokens_by_k: list[float] | None = None   # [cap + 1] expected tokens at each K given a proposal (else the
                                             # per-token formula)
    match: float = 1.0             # how often the proposer has a proposal when asked
    after_hit: list[float] | None = None   # [cap + 1] tokens_by_k after a proposal whose first token was accepted
                                           # (a bursty proposer: what a try that hits leads to)
    catchup_now_s: float = 0.0     # the same prefill paid at once, by the next step that drafts
    remaining: int = 0             # tokens the request has left (what that is weighed against: explore)
    deepen: bool = False           # positions past the chosen K are priced by a continuation guess (a draft
                                   # model or a head: BatchAdaptiveK._deepened asks them now and then)

    def given_proposal(self, k: int) -> float:
        if self.tokens_by_k is not None and k < len(self.tokens_by_k):
            return self.tokens_by_k[k]
        return expected_tokens(self.acceptance, k)

    def expected(self, k: int) -> float:
        """Expected tokens of a step asking this row for k drafts."""
        return 1.0 + self.match * (self.given_proposal(k) - 1.0) if k else 1.0


def with_proposal(spec: RowSpec, acceptance: AcceptanceEstimate, length: int, match: int | None) -> RowSpec:
    """A row's spec once its cheap proposer has proposed `length` tokens (0: nothing) of context match length
    `match` (None: unknown): K at most its length, certain to have it, priced by its match bucket, its cost spent."""
    if not length:
        return dataclasses.replace(spec, cap=0, match=0.0)
    cap = min(spec.cap, length)
    return dataclasses.replace(spec, cap=cap, match=1.0, propose_s_per_token=0.0,
                               tokens_by_k=acceptance.tokens_by_k(cap, match), after_hit=None)


@dataclass(frozen=True)
class Alternative:
    """The best-priced K > 0 when the best is K = 0."""
    k: int            # 0: none worth trying
    near: bool        # priced within NEAR of plain decoding: the estimates' noise could explain the gap
    upside: bool = False   # every row is bursty and drafting pays after a hit: a try that hits finds a stretch
                           # where it pays, and waiting would miss it


class BatchAdaptiveK:
    """The K of the best predicted token rate over a batch's rows (see above)."""

    def __init__(self, costs: BatchCostModel, enabled: bool = True, min_gain: float = 0.03):
        self.costs = costs
        self.enabled = enabled
        # A batch drafts only when the model predicts at least this gain over K = 0: near the break-even point (a
        # filling batch) the prediction rests on costs measured at other contexts and loads, and a wrong call
        # there makes the server slower than plain decoding; a small margin buys "never slower" for little.
        self.min_gain = min_gain
        # Every deepen_every-th drafting step asks a draft model or a head (copying proposers propose before K is
        # chosen and keep acceptance per match length) for more drafts than the best K, when a deeper K is priced
        # within NEAR of it. Why: positions past the chosen K are never asked, so they stay priced by a
        # continuation guess; on the embedded target and its draft (1 thread) the policy held K = 3 (37-38 target
        # forwards for 96 tokens, 1.54-1.68x plain) where fixed K = 5 measured 1.90x (28 forwards). One step in
        # deepen_every pays at most NEAR of a step: under 2% of drafting's time.
        self.deepen_every = 8
        self._drafting_steps = 0

    def rate(self, rows: list[RowSpec], K: int) -> float:
        """Expected tokens per second of a step with K over these rows."""
        return sum(r.expected(min(K, r.cap)) for r in rows) / self._step_seconds(rows, K)

    def _step_seconds(self, rows: list[RowSpec], K: int) -> float:
        """Expected seconds of a step with K over these rows (a draft model's catching up spread over the
        request)."""
        n = len(rows)
        if n == 1:                     # a request alone (the common case, priced at every step): the same sum
            r, k = rows[0], min(K, rows[0].cap)
            m = min(1.0, max(0.0, r.match)) if k else 0.0
            return ((1.0 - m) * self.costs.cost(1, 1) + (m * self.costs.cost(1, k + 1 + round(r.extra_tokens))
                    + r.match * k * r.propose_s_per_token + r.catchup_s if k else 0.0))
        drafting = [(r, min(K, r.cap)) for r in rows if min(K, r.cap)]
        if not drafting:
            return self.costs.cost(n, 1)
        extra = round(max(r.extra_tokens for r, _ in drafting))
        # the block is as wide as the longest draft of a row that has a proposal (rows independent)
        forward, p_narrower = 0.0, 1.0          # p_narrower: no row with a longer draft has a proposal
        for w in sorted({k for _, k in drafting}, reverse=True):
            p_none = math.prod(1.0 - min(1.0, max(0.0, r.match)) for r, k in drafting if k == w)
            forward += p_narrower * (1.0 - p_none) * self.costs.cost(n, w + 1 + extra)
            p_narrower *= p_none
        forward += p_narrower * self.costs.cost(n, 1)
        return forward + sum(r.match * k * r.propose_s_per_token + r.catchup_s for r, k in drafting)

    def best(self, rows: list[RowSpec]) -> int:
        k_max = max((r.cap for r in rows), default=0)
        plain = self.rate(rows, 0)
        best_k, best = 0, plain * (1 + self.min_gain)
        for K in range(1, k_max + 1):
            r = self.rate(rows, K)
            if r > best:
                best_k, best = K, r
        return best_k

    def choose(self, rows: list[RowSpec]) -> int:
        """The step's K: the best predicted (every cap when the policy is off), now and then a deeper one."""
        k_max = max((r.cap for r in rows), default=0)
        if k_max == 0:
            return 0
        if not self.enabled:
            return k_max
        K = self.best(rows)
        return self._deepened(rows, K, k_max) if K else 0

    def explore(self, rows: list[RowSpec]) -> Alternative:
        """What K > 0 the measured rates may try while the best is K = 0 (measured.RateBandit.decide): the best
        priced, none when even perfect acceptance would not pay (drafting a token would only cost) or when a row
        would first pay a draft model's catching up beyond CATCHUP_BUDGET of the plain steps its request has left
        (on SmolLM2, where its draft never paid, a try that catches up on a whole prompt cost 3-6 plain steps, a
        few percent of a 128-token request)."""
        k_max = max((r.cap for r in rows), default=0)
        perfect = [dataclasses.replace(r, acceptance=1.0, tokens_by_k=None, match=1.0) for r in rows]
        if not self.enabled or k_max == 0 or self.best(perfect) == 0:
            return Alternative(0, False)
        rates = {k: self.rate(rows, k) for k in range(1, k_max + 1)}
        best = max(rates, key=rates.get)
        hit = [dataclasses.replace(r, tokens_by_k=r.after_hit) for r in rows if r.after_hit is not None]
        upside = self.best(hit) if len(hit) == len(rows) else 0       # tried at the K that pays after a hit
        k = upside or best
        plain = self.costs.cost(len(rows), 1)
        if any(min(k, r.cap) and r.catchup_now_s > CATCHUP_BUDGET * r.remaining * plain for r in rows):
            return Alternative(0, False)
        return Alternative(k, rates[best] >= self.rate(rows, 0) * (1 - NEAR), bool(upside))

    def _deepened(self, rows: list[RowSpec], K: int, k_max: int) -> int:
        """K, or on every deepen_every-th drafting step the best-priced K' > K while it is priced within NEAR of
        K (above): a cost shape with a cheap block at K + 1 (the embedded target's T = 4) would otherwise keep a
        deeper K that pays from ever being asked."""
        self._drafting_steps += 1
        if self._drafting_steps % self.deepen_every or not any(r.deepen and r.cap > K for r in rows):
            return K
        rates = {k: self.rate(rows, k) for k in range(K + 1, k_max + 1)}
        deeper = max(rates, key=rates.get)
        return deeper if rates[deeper] >= self.rate(rows, K) * (1 - NEAR) else K

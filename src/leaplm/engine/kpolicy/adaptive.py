"""Adaptive K, the one K policy's choice: each step's K from measured costs and measured acceptance, down to 0
(no speculation) when speculating would be slower than plain decoding. A single request is a batch of one.

The inputs are per row (`RowSpec`: its cap, its acceptance estimate from engine/kpolicy/acceptance.py, its proposer's
cost) and the target's costs per (rows, block length) (engine/kpolicy/costs.py: a level that follows the load times a
shape measured pairwise at start-up); the step's cost is the wide forward only when some row has a proposal.
Cheap proposers (n-gram, suffix: a proposal costs next to nothing) propose before K is chosen, at their row's
cap (`with_proposal`): whether a row has a proposal is then known, its length caps the row's K, its match length
selects the acceptance estimate, and its cost is spent whatever K is chosen, so it is not charged. When K falls
to 0 engine/kpolicy/probes.py decides when to try K > 0 again. engine/kpolicy/policy.py wires this to the batch step.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .acceptance import AcceptanceEstimate, expected_tokens
from .costs import BatchCostModel
from .probes import ProbeSchedule


# With n rows verified in one forward of n x (K + 1) tokens, the step's K maximises the batch's token rate
#   sum_i (1 + m_i G_i(k_i)) / (E[cost(n, 1 + the longest k_i among rows that have a proposal)]
#                               + sum_i [m_i k_i propose_s_i + catchup_i])
# where k_i = min(K, cap_i), cap_i is row i's own K (0 for a row that does not speculate), m_i how often row i's
# proposer has a proposal, G_i its expected accepted tokens given one, and catchup_i (only for rows that draft)
# a draft model's prefill of unseen tokens spread over the request's remaining steps; K > 0 must beat K = 0 by
# min_gain. As n grows the forward turns compute-bound, cost(n, K + 1) outgrows the tokens it buys and K falls
# to 0: speculation never makes a full batch slower than plain decoding.


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
    tokens_by_k_after_hit: list[float] | None = None   # [cap + 1] the same after a proposal whose first token
                                                       # was accepted (what a probe that hits leads to)
    catchup_now_s: float = 0.0     # the same prefill paid at once, by the next step that drafts (a probe's cost)
    remaining: int = 0             # tokens the request has left (what a probe's catching up is weighed against)
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
                               tokens_by_k=acceptance.tokens_by_k(cap, match), tokens_by_k_after_hit=None)



@dataclass
class Overrun:
    """How much more (or less) than predicted a step that drafts costs, relative to a plain step: the fastest
    measured / predicted seconds of each over their last `window` steps; their ratio (once 3 drafting steps are
    measured) scales the predicted seconds of drafting. The prediction prices chain forwards and a proposal per
    drafted token; a tree proposal (several head levels whatever K, the race over the vocabulary at each node),
    its tree-masked forward, or a head catching up on the context it skipped at K = 0 cost more (unpriced, those
    costs held the head methods at 0.87-0.97x plain decoding with K ~ 0 on the embedded target). A start-up
    calibration that met a busy machine prices a block dearer than it is (the embedded target: blocks of 3-6
    tokens at 2.3x a one-token forward where a quiet machine measures 1.7-1.8x, kept in the start-up cache for
    every later process), which the ratio corrects too, down to `floor`: while a request drafts, the cost
    model's level follows its blocks' times divided by that shape, so its next plain step measures dearer than
    predicted by the same factor.

    Why the fastest, as the start-up calibration keeps (costs.BatchCostModel.calibrated): other processes only add
    to a step's time, and a few drafting steps that met them (one of 224 ms and one of 460 ms where a plain step
    took 20-60 ms, on a machine running other jobs) would otherwise price drafting out of a request that pays."""
    slack: float = 0.05            # what the ratio shows of noise alone: not charged
    window: int = 8
    floor: float = 0.5
    drafting: list[float] = field(default_factory=list)    # [<= window] measured / predicted of drafting steps
    plain: list[float] = field(default_factory=list)       # [<= window] ... of plain steps
    value: float = 1.0

    def observe(self, drafted: bool, measured_over_predicted: float) -> None:
        kept = self.drafting if drafted else self.plain
        kept.append(measured_over_predicted)
        del kept[:-self.window]
        if len(self.drafting) >= 3:
            r = min(self.drafting) / (min(self.plain) if self.plain else 1.0)
            self.value = (r - self.slack if r > 1 + self.slack else
                          max(self.floor, r + self.slack) if r < 1 - self.slack and self.plain else 1.0)


class BatchAdaptiveK:
    """Chooses the K of each batched step from measured forward costs and per-row acceptance (see above): the K
    of the best predicted token rate (K > 0 must beat K = 0 by min_gain), drafting priced at the measured
    overrun; at K = 0 chosen for low acceptance (not for cost: when even perfect acceptance would not pay at this
    batch size, drafting a token would only cost) the probe schedule (engine/kpolicy/probes.py) tries K > 0 now and then.
    Every step is measured (observe_step, from the step)."""

    def __init__(self, costs: BatchCostModel, enabled: bool = True, min_gain: float = 0.03, **probe_settings):
        self.costs = costs
        self.enabled = enabled
        # A batch drafts only when the model predicts at least this gain over K = 0: near the break-even point (a
        # filling batch) the prediction rests on costs measured at other contexts and loads, and a wrong call
        # there makes the server slower than plain decoding; a small margin buys "never slower" for little.
        self.min_gain = min_gain
        self.probes = ProbeSchedule(**probe_settings)
        self.over = Overrun()
        # Every deepen_every-th drafting step asks a draft model or a head (copying proposers propose before K is
        # chosen and keep acceptance per match length) for more drafts than the best K, when a deeper K is priced
        # within the probes' `near` of it. Why: positions past the chosen K are never asked, so they stay priced by a
        # continuation guess; on the embedded target and its draft (1 thread) the policy held K = 3 (37-38 target
        # forwards for 96 tokens, 1.54-1.68x plain) where fixed K = 5 measured 1.90x (28 forwards). One step in
        # deepen_every pays at most `near` of a step, spread over eight: under 2% of drafting's time.
        self.deepen_every = 8
        self._drafting_steps = 0
        self.plain_s: dict[int, float] = {}      # n -> EMA of a K = 0 step's seconds over n rows
        self._predicted = 0.0    # the predicted seconds of the step now running (its chosen K, proposals made)
        self._chosen = 0         # ... and its K
        self._live = False       # ... predicted from a level that live forwards set (costs.BatchCostModel.live)

    @property
    def overrun(self) -> float:
        return self.over.value

    @property
    def near(self) -> float:
        return self.probes.near

    @property
    def probe_budget(self) -> float:
        return self.probes.probe_budget

    def rate(self, rows: list[RowSpec], K: int) -> float:
        """Expected tokens per second of a step with K over these rows."""
        return sum(r.expected(min(K, r.cap)) for r in rows) / self._step_seconds(rows, K)

    def _step_seconds(self, rows: list[RowSpec], K: int, measured: bool = True, catchup: bool = True) -> float:
        """Expected seconds of a step with K over these rows (measured: scaled by the measured overrun; catchup:
        with a draft model's catching up, spread over the request)."""
        n = len(rows)
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
        predicted = forward + sum(r.match * k * r.propose_s_per_token + (r.catchup_s if catchup else 0.0)
                                  for r, k in drafting)
        return predicted * (self.overrun if measured else 1.0)

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
        K = self._choose(rows)
        # what the step will cost if every asked row has a proposal (compared only with steps that drafted), without
        # the catching up that the prediction spreads over the request and the step pays at once (measured apart)
        sure = [dataclasses.replace(r, match=1.0) for r in rows] if K else rows
        self._predicted = self._step_seconds(sure, K, measured=False, catchup=False) if rows else 0.0
        self._live = bool(rows) and self.costs.live(len(rows))
        self._chosen = K
        return K

    def overruled(self, K: int, rows: list[RowSpec]) -> None:
        """The measured rates (measured.py) changed the chosen K: the step is predicted, held and compared as K."""
        if K != self._chosen:
            self._chosen = K
            self._predicted = self._step_seconds(rows, K, measured=False, catchup=False) if rows else 0.0
            self.probes.probing = self.probes.measuring = False

    def hold(self, n: int) -> bool:
        """K = 0 again over the same n rows without pricing the step, when the last step chose K = 0 and no probe
        is due: True when held (the step is counted towards the next probe). The caller checks that nothing the
        choice read has changed (kpolicy.KPolicy: the rows and their acceptance estimates)."""
        if self._chosen or self.probes.due_next(n):
            return False
        self.probes.due(n)
        self.probes.probing = False
        self._predicted = self.costs.cost(n, 1)
        self._live = self.costs.live(n)
        return True

    def _choose(self, rows: list[RowSpec]) -> int:
        probes = self.probes
        probes.probing = False
        k_max = max((r.cap for r in rows), default=0)
        if k_max == 0:
            return 0
        if not self.enabled:
            return k_max
        n = len(rows)
        K = self.best(rows)
        if K > 0:
            probes.drafting(n)
            return self._deepened(rows, K, k_max)
        if not probes.due(n):
            return 0
        # checked only when a probe is due (a step at K = 0 should cost next to nothing)
        perfect = [dataclasses.replace(r, acceptance=1.0, tokens_by_k=None, match=1.0) for r in rows]
        if self.best(perfect) == 0:
            return 0
        rates = {k: self.rate(rows, k) for k in range(1, k_max + 1)}
        probe = max(rates, key=rates.get)
        near = rates[probe] >= self.rate(rows, 0) * (1 - probes.near)
        # a proposer that is good after a hit (bursty: n-gram) earns a bigger budget and a probe at the K that
        # pays after a hit: a probe that hits finds a stretch where drafting pays, and waiting would miss it
        hit = [dataclasses.replace(r, tokens_by_k=r.tokens_by_k_after_hit) for r in rows
               if r.tokens_by_k_after_hit is not None]
        upside = self.best(hit) if len(hit) == n else 0
        probe = upside or probe
        # a draft model's catching up on what it has not seen (the whole prompt, at a request's first probe) is paid
        # at once by the probe, whatever it finds: a row probes only while that fits the probe budget of the plain
        # steps its request has left (on SmolLM2, where its draft never paid, each request's one probe cost a
        # prompt's prefill of 3-6 plain steps, a few percent of a 128-token request)
        plain = self.costs.cost(n, 1)
        if any(min(probe, r.cap) and r.catchup_now_s > probes.probe_budget * r.remaining * plain for r in rows):
            probes.defer(n)
            return 0
        plain = self.costs.cost(n, 1)
        # what a probe is expected to cost, in steps of plain decoding
        cost = self._step_seconds(rows, probe) / plain - 1.0
        probes.start(n, cost, near, bool(upside))
        return probe

    def _deepened(self, rows: list[RowSpec], K: int, k_max: int) -> int:
        """K, or on every deepen_every-th drafting step the best-priced K' > K while it is priced within `near` of
        K (above): a cost shape with a cheap block at K + 1 (the embedded target's T = 4) would otherwise keep a
        deeper K that pays from ever being asked."""
        self._drafting_steps += 1
        if self._drafting_steps % self.deepen_every or not any(r.deepen and r.cap > K for r in rows):
            return K
        rates = {k: self.rate(rows, k) for k in range(K + 1, k_max + 1)}
        deeper = max(rates, key=rates.get)
        return deeper if rates[deeper] >= self.rate(rows, K) * (1 - self.probes.near) else K

    def probed(self, any_proposal: bool) -> None:
        """After a probe's propose: when no row had a proposal, probe again at the next step (no back-off)."""
        self.probes.proposed(any_proposal)

    def observe_step(self, n: int, drafted: int, seconds: float, tokens: int, chosen: bool = True,
                     catchup_s: float = 0.0) -> None:
        """A step over n rows that drafted `drafted` tokens (all rows) took `seconds` (catchup_s of them a draft
        model catching up) and yielded `tokens`: a plain step is the reference; a probe's loss against it sets the
        shortest wait before the next one. chosen: the step ran the K this policy chose (not one forced by fixed-K
        rows), so its prediction is comparable."""
        # not compared: a K > 0 without proposals (neither kind of step), a prediction from the start-up level
        # (measured at another load, or read from another process's start-up cache)
        if chosen and self._live and self._predicted > 0 and (drafted > 0) == (self._chosen > 0):
            self.over.observe(drafted > 0, max(0.0, seconds - catchup_s) / self._predicted)
        if not drafted:
            old = self.plain_s.get(n)
            self.plain_s[n] = seconds if old is None else 0.9 * old + 0.1 * seconds
        elif self.probes.measuring and chosen:
            self.probes.measured(n, seconds, tokens, self.plain_s.get(n) or self.costs.cost(n, 1))
        self.probes.measuring = False


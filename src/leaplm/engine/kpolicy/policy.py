"""How K is chosen, end to end: the K policy as the batch step sees it (plan a step, observe what it did). Start here
(docs/adaptive-k.md).

plan: one K for the step; row i drafts min(K, cap_i).
  1. cap_i: the row's own K cut to its room in the cache and its remaining tokens; 0 for a row without a
     proposer, a row whose drafts are free this step (a grammar's forced tokens: drafted whatever K is), and,
     under the adaptive policy, a row's first step (its first token costs one target forward, not a draft
     model catching up with the prompt as well).
  2. Each row's spec (adaptive.RowSpec): its acceptance estimate (acceptance.py: tokens expected at each K given
     a proposal, how often it has one), its proposer's seconds per drafted token (estimates.py), a draft model's
     catching up on tokens it has not seen.
  3. Cheap proposers (n-gram, suffix: a proposal costs next to nothing) propose now, at their cap: a row with
     no proposal drafts nothing, one with a proposal is priced by its length and context match length. While
     a batch of EARLY_ROWS rows or more decodes plainly they do so every EARLY_EVERY steps (a row with a
     prediction: every step), the rows priced without a proposal in hand on the others.
  4. The cost model (adaptive.BatchAdaptiveK.choose) takes the K of the best predicted tokens per second over
     the rows that follow the policy (costs.py: a forward over n rows of K + 1 tokens on this machine); K > 0
     must beat K = 0 by 3%.
  5. The measured rates (measured.RateBandit.decide) take that K as their prior: every step's committed tokens
     per wall-second are kept per K and arm class (the rows' methods and temperature bands, the rows bucket), and
     overrule a K measured to lose against plain decoding, or measured to lose against another K; while the
     model says K = 0 they try its best K > 0 after a bounded, budgeted wait (adaptive.BatchAdaptiveK.explore).
  6. A row that asked for a fixed K drafts its cap; K is cut to the cache's room.

observe: what each row drafted and accepted feeds its estimate and its method's (carried to later requests of the
process: priors.py); a row that decoded plainly is scored on what its proposer would have drafted (shadow.py), so
K = 0 keeps learning; the step's wall seconds (its K = 0 evidence included) and committed tokens feed the measured
rate of its K. Forward times refresh the cost model (observe_forward), proposing times their price
(observe_propose). Costs and acceptance are the engine's (estimates.Estimates), shared by its batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...propose.base import Proposal
from ..row import Row
from .acceptance import AcceptanceEstimate, expected_tokens
from .adaptive import BatchAdaptiveK, RowSpec, with_proposal
from .estimates import Estimates, rows_bucket
from .priors import from_card
from .shadow import forget, gather, tokens_left


# While the last step of a batch of at least EARLY_ROWS rows drafted nothing, cheap proposers propose before K is
# chosen on one step in EARLY_EVERY: at 4 and 16 rows of SmolLM2 at K = 0 (2 threads), asking every row at every
# step cost 3-4% of plain decoding's rate (the lookups, their pricing per match length and their evidence); a
# copying stretch is still found within a step or two of its start, and once a step drafts they propose at every
# step again. Fewer rows: every step (a row's lookup is a small share of a step's forward there).
EARLY_EVERY = 3
EARLY_ROWS = 4


@dataclass
class StepPlan:
    """What a step drafts."""
    k: int                                 # the step's K (0: no row drafts)
    asked: list[int]                       # [n] drafts asked of each row: min(K, its cap)
    early: dict[int, Proposal | None]      # rows whose cheap proposer proposed before K was chosen (None: nothing)
    chosen: bool                           # K is the policy's own choice (not raised by a fixed-K row)
    arm: tuple | None = None               # the step's arm class (measured.py), None: not measured
    expected: float | None = None          # the tokens the cost model expects of the step, its own K (every row)


@dataclass
class RowStep:
    """What one row did in a step, for the policy."""
    drafted: int                           # draft tokens verified (0: none)
    accepted: int
    scored: int                            # tokens the target scored for the row (its block, extra tokens too)
    match: int | None = None               # the proposal's context match length (cheap proposers)
    logits: object = None                  # [scored, V] the target's logits of the row's block (evidence at K = 0)


class KPolicy:
    def __init__(self, estimates: Estimates, enabled: bool, max_len: int):
        self.estimates = estimates
        self.choice = BatchAdaptiveK(estimates.costs, enabled=enabled)
        self.max_len = max_len
        self.plans = 0                     # steps planned
        self.drafted = False               # the last observed step drafted

    @property
    def enabled(self) -> bool:
        return self.choice.enabled

    def new_acceptance(self, method: str, bursty: bool, band: str = "greedy",
                       predicted: bool = False) -> AcceptanceEstimate:
        """A joining row's estimate: what its method measured on earlier requests in its temperature band (this
        engine's or another of the process with the same target and proposer: priors.py), else its proposer's
        card, else the prior. A row with a prediction (propose/prediction.py) starts from the prior: what its
        method measured without one says nothing of a text the output is expected to repeat (suffix's card on
        SmolLM2's chats kept an edit's prediction at K = 0 for most of a first request)."""
        if predicted:
            return AcceptanceEstimate(bursty=True)
        seen = self.estimates.method_acceptance.get((method, band))
        if seen is not None:
            return AcceptanceEstimate.seeded(seen)
        if band in self.estimates.card:
            return from_card(self.estimates.card[band], bursty)
        return AcceptanceEstimate(bursty=bursty)

    # --- plan ----------------------------------------------------------------------------------------------------
    def plan(self, rows: list[Row], propose_cheap: Callable[[int, int], Proposal | None], room: int,
             free: frozenset[int] = frozenset()) -> StepPlan:
        """propose_cheap(i, cap): row i's cheap proposer's proposal at its cap (None: nothing). room: the most
        drafts the cache has slots (and positions) for in every row. free: rows whose drafts this step cost nothing
        to propose (a grammar's forced tokens): their proposers are not asked."""
        drafting = _drafting_rows(rows)
        specs = [RowSpec(0, 0.0, 0.0) if i in free else self._row_spec(r, drafting)       # 1, 2
                 for i, r in enumerate(rows)]
        early: dict[int, Proposal | None] = {}
        self.plans += 1
        every = self.drafted or len(rows) < EARLY_ROWS or (self.plans - 1) % EARLY_EVERY == 0
        for i, (r, sp) in enumerate(zip(rows, specs)):                                     # 3
            if sp.cap > 0 and r.proposer.cheap and (every or r.req.params.prediction is not None):
                p = early[i] = propose_cheap(i, sp.cap)
                r.acceptance.observe_match(p is not None)
                self.estimates.acceptance(r.req.stats.method, r.proposer.bursty, r.band).observe_match(p is not None)
                specs[i] = with_proposal(sp, r.acceptance, p.k if p is not None else 0,
                                         p.match if p is not None else None)
        priced = [sp for sp, r in zip(specs, rows) if not r.fixed_k]
        K = model = self.choice.choose(priced)                                             # 4
        arm = arm_class(rows) if self.enabled else None
        if arm is not None:                                                                # 5
            K = self.estimates.rates.decide(arm, K, lambda: self.choice.explore(priced))
        step_k = min(max([K] + [sp.cap for sp, r in zip(specs, rows) if r.fixed_k]), room)  # 6
        asked = [min(step_k, sp.cap) for sp in specs]
        # what the model expects of its own K (the measured rates judge its seconds by it: ArmClass.costs_more)
        expected = sum(sp.expected(k) for sp, k in zip(specs, asked)) if step_k == model else None
        return StepPlan(step_k, asked, early, step_k == K, arm, expected)

    def _row_spec(self, r: Row, drafting: dict[str, int]) -> RowSpec:
        room = max(0, self.max_len - len(r.req.tokens) - 1)
        first = r.req.stats.target_forwards == 0 and self.enabled and not r.fixed_k
        cap = max(0, min(r.cap, room, r.req.remaining - 1)) if r.proposer is not None and not first else 0
        method = r.req.stats.method
        now = self.catchup_now_s(r)
        return RowSpec(cap, r.acceptance.rate, self.estimates.propose_cost(method, drafting.get(method, 1)),
                       self._spread(r, now), extra_tokens=r.extra_tokens, tokens_by_k=r.acceptance.tokens_by_k(cap),
                       match=r.acceptance.match, after_hit=r.acceptance.tokens_by_k_after_hit(cap),
                       catchup_now_s=now, remaining=tokens_left(r.req),
                       deepen=r.proposer is not None and not r.proposer.bursty)

    def catchup_now_s(self, r: Row) -> float:
        """Seconds a draft model needs to prefill what it has not seen (a row that has not drafted yet: its whole
        context), paid by the next step that drafts."""
        per_token = self.estimates.draft_prefill_s_per_token
        lag = r.proposer.lag(len(r.req.tokens)) if r.proposer is not None and per_token else 0
        return lag * per_token

    def catchup_s(self, r: Row) -> float:
        """The same spread over the steps the request has left: near the end of a request it does not pay."""
        return self._spread(r, self.catchup_now_s(r))

    def _spread(self, r: Row, seconds: float) -> float:
        if not seconds:
            return 0.0
        steps_left = max(1.0, tokens_left(r.req) / expected_tokens(r.acceptance.rate, max(1, r.cap)))
        return seconds / steps_left

    # --- observe (engine/observer.py: StepObserver) ---------------------------------------------------------------
    def measured_rates(self) -> dict[tuple, dict[int, float]]:
        """Committed tokens per wall-second per arm class and K (measured.RateBandit.rates): the read API."""
        return self.estimates.rates.rates()

    def observe_propose(self, method: str, seconds_per_token: float, rows: int | None = None) -> None:
        self.estimates.observe_propose(method, seconds_per_token, rows=rows)

    def observe_forward(self, rows: int, block_len: int, seconds: float) -> None:
        self.estimates.costs.observe(rows, block_len, seconds)

    def observe(self, rows: list[Row], plan: StepPlan, done: list[RowStep | None], timed: bool = True,
                wall: float | None = None) -> None:
        """done[i]: what row i did (None: it failed). wall: the step's wall seconds (propose, score, verify,
        commit), counted with its K = 0 evidence towards the measured rate of its K. timed False: the step carried
        free drafts (a grammar's forced tokens), no choice of K: its rate is not counted."""
        self.drafted = plan.k > 0
        evidence = sum(r.shadow.seconds for r in rows)
        off = plan.arm is not None and self.estimates.rates.off(plan.arm)
        for i, (r, d) in enumerate(zip(rows, done)):
            if d is not None and plan.asked[i]:
                self._observe_row(r, d, plan.asked[i], known=i in plan.early)
            if d is not None and self.enabled and not r.fixed_k and r.proposer is not None:
                if off:                 # drafting measured below plain: the evidence is not worth its cost
                    forget(r.shadow)
                else:
                    self._shadow(r, d, plan, i)
        if plan.arm is None or wall is None or not timed or not plan.chosen or any(d is None for d in done):
            return
        drafted = sum(d.drafted for d in done)
        tokens = len(rows) + sum(d.accepted for d in done)
        wall += sum(r.shadow.seconds for r in rows) - evidence
        self.estimates.rates.observe(plan.arm, plan.k, tokens, wall, most=len(rows) + drafted,
                                     level=self.estimates.costs.cost(len(rows), 1), expected=plan.expected,
                                     drafted=drafted)

    def _shadow(self, r: Row, d: RowStep, plan: StepPlan, i: int) -> None:
        gather(r, d, plan.asked[i], plan.early.get(i), self.estimates)

    def _observe_row(self, r: Row, d: RowStep, asked: int, known: bool) -> None:
        """d.drafted 0: the row was asked for drafts and its proposer had none (counts only towards `match`).
        known: the proposal was made before K was chosen, of context match length d.match."""
        match = d.match if d.drafted else None
        r.acceptance.observe(d.drafted, d.accepted, max(asked, d.drafted), match, known)
        self.estimates.observe_acceptance(r.req.stats.method, d.drafted, d.accepted, max(asked, d.drafted), match,
                                          known, r.proposer.bursty, r.band)
        if d.drafted:
            extra = max(0, d.scored - d.drafted - 1)
            r.extra_tokens = extra if r.extra_tokens == 0 else 0.9 * r.extra_tokens + 0.1 * extra


def arm_class(rows: list[Row]) -> tuple:
    """The arm class of a step over these rows (measured.py): their methods and temperature bands (greedy or
    sampled, structured or free) and their rows bucket."""
    return tuple(sorted({(r.req.stats.method, r.band) for r in rows})), rows_bucket(len(rows))


def _drafting_rows(rows: list[Row]) -> dict[str, int]:
    """method -> rows that would draft together in this step (a group's cost per token depends on it)."""
    out: dict[str, int] = {}
    for r in rows:
        if r.proposer is not None and r.proposer.group is not None:
            out[r.req.stats.method] = out.get(r.req.stats.method, 0) + 1
    return out

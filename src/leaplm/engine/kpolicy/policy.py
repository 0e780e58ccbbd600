"""The K policy as the batch step sees it: plan a step (each row's K), observe what the step did.

  plan     each row's cap (its own K, its room, nothing on a row's first step under the adaptive policy: its first
           token costs one target forward, not a draft model catching up with the prompt as well), the cheap
           proposers' proposals made at that cap, then one K for the step (adaptive.BatchAdaptiveK over the rows
           that follow the policy, then measured.RateBandit: the measured rates of the step's arm class overrule
           a K measured to lose against plain decoding; a row that asked for a fixed K drafts its cap) ->
           StepPlan. At K = 0 over the same rows with no new acceptance evidence (a draft model or a head learns
           nothing while it does not draft), the step is not priced again until a probe is due (at most HOLD_STEPS steps): a plain step
           then costs what plain decoding costs, not a pricing of every K
  proposed whether any row had a proposal (a probe without one is retried at the next step)
  observe  per row: drafted, accepted, the tokens scored (acceptance estimates, per row and per method); the step's
           seconds without its commits (the overrun of drafting, probe losses); its wall seconds with its K = 0
           evidence and its committed tokens (the measured rate of its K). A row that decoded plainly is
           scored on what its proposer would have drafted (shadow.py), so K = 0 keeps learning

Costs and acceptance are the engine's (estimates.Estimates): one calibration, shared by every batch of an engine.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from ...propose.base import Proposal
from .acceptance import AcceptanceEstimate, expected_tokens
from .adaptive import BatchAdaptiveK, RowSpec, with_proposal
from .estimates import Estimates, rows_bucket
from .priors import from_card
from .shadow import (SHADOW_CHUNK, forget, keep_cheap, keep_probs, resolve_cheap, resolve_guesses,
                     score_guesses)
from ..row import Row

# Steps at K = 0 held without pricing before the choice is priced again (the costs' level moves with the load)
HOLD_STEPS = 16
# A draft model's long catching up at K = 0 (a new row's prompt; every scoring of a constrained row) waits until it
# fits, with the evidence's seconds so far, within this share of its row's decoding so far and of the plain steps
# its request has left (shadow.py)
SHADOW_BUDGET = 0.015
# All of a draft model's evidence at K = 0 (its scorings, and under rejection sampling the target's top tokens kept
# at every plain step: a softmax over SmolLM2's 49k vocabulary costs several percent of its 4.5 ms step) at most
# this share of its row's decoding so far
SHADOW_SHARE = 0.03


@dataclass
class StepPlan:
    """What a step drafts."""
    k: int                                 # the step's K (0: no row drafts)
    asked: list[int]                       # [n] drafts asked of each row: min(K, its cap)
    early: dict[int, Proposal | None]      # rows whose cheap proposer proposed before K was chosen (None: nothing)
    chosen: bool                           # K is the policy's own choice (not raised by a fixed-K row)
    arm: tuple | None = None               # the step's arm class (measured.py), None: not measured


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
        self._held: tuple | None = None      # what the last K = 0 choice read (_hold_key), None: not held
        self._held_steps = 0

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
        key = self._hold_key(rows, free)
        if key is not None and key == self._held and self._held_steps < HOLD_STEPS and self.choice.hold(len(rows)):
            self._held_steps += 1
            return StepPlan(0, [0] * len(rows), {}, True, arm_class(rows))
        drafting = _drafting_rows(rows)
        # a row whose drafts are free this step is not priced (it drafts its forced tokens whatever K is)
        specs = [RowSpec(0, 0.0, 0.0) if i in free else self._row_spec(r, drafting) for i, r in enumerate(rows)]
        early: dict[int, Proposal | None] = {}
        for i, (r, sp) in enumerate(zip(rows, specs)):
            if sp.cap > 0 and r.proposer.cheap:
                p = early[i] = propose_cheap(i, sp.cap)
                r.acceptance.observe_match(p is not None)
                self.estimates.acceptance(r.req.stats.method, r.proposer.bursty, r.band).observe_match(p is not None)
                specs[i] = with_proposal(sp, r.acceptance, p.k if p is not None else 0,
                                         p.match if p is not None else None)
        priced = [sp for sp, r in zip(specs, rows) if not r.fixed_k]
        chosen = model = self.choice.choose(priced)
        arm = arm_class(rows) if self.enabled else None
        if arm is not None:             # the cost model's choice is the prior; measured rates overrule it
            chosen = self.estimates.rates.decide(arm, model)
            self.choice.overruled(chosen, priced)
        K = max([chosen] + [sp.cap for sp, r in zip(specs, rows) if r.fixed_k])   # a fixed-K row drafts its K
        K = min(K, room)
        # held: the cost model chose K = 0 (a K = 0 the measured rates chose is decided by them at every step)
        held = key is not None and K == 0 and model == 0 and not self.choice.probes.retry
        self._held, self._held_steps = (key if held else None), 0
        return StepPlan(K, [min(K, sp.cap) for sp in specs], early, K == chosen, arm)

    def _hold_key(self, rows: list[Row], free: frozenset[int]) -> tuple | None:
        """What a K = 0 choice over these rows read that can change between steps: drafting's measured overrun
        (plain steps move it), each row, its acceptance evidence, whether it is on its first step. None: rows whose
        plan cannot be held (a cheap proposer proposes anew at every step, a fixed-K row drafts, a grammar's forced
        tokens are free)."""
        if not self.enabled or free or any(r.fixed_k or (r.proposer is not None and r.proposer.cheap) for r in rows):
            return None
        return (self.choice.overrun,) + tuple((id(r), r.acceptance.version, r.req.stats.target_forwards == 0)
                                               for r in rows)

    def _row_spec(self, r: Row, drafting: dict[str, int]) -> RowSpec:
        room = max(0, self.max_len - len(r.req.tokens) - 1)
        first = r.req.stats.target_forwards == 0 and self.enabled and not r.fixed_k
        cap = max(0, min(r.cap, room, r.req.remaining - 1)) if r.proposer is not None and not first else 0
        method = r.req.stats.method
        now = self.catchup_now_s(r)
        return RowSpec(cap, r.acceptance.rate, self.estimates.propose_cost(method, drafting.get(method, 1)),
                       self._spread(r, now), extra_tokens=r.extra_tokens, tokens_by_k=r.acceptance.tokens_by_k(cap),
                       match=r.acceptance.match, tokens_by_k_after_hit=r.acceptance.tokens_by_k_after_hit(cap),
                       catchup_now_s=now, remaining=tokens_left(r.req), deepen=not r.proposer.bursty
                       if r.proposer is not None else False)

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

    def proposed(self, proposals: list[Proposal | None]) -> None:
        self.choice.probed(any(p is not None for p in proposals))

    def observe(self, rows: list[Row], plan: StepPlan, done: list[RowStep | None], seconds: float,
                catchup_s: float, timed: bool = True, wall: float | None = None) -> None:
        """done[i]: what row i did (None: it failed). seconds: the step's time without its commits (paid per
        token, drafted or not: they do not make drafting dearer); catchup_s: a draft model's catching up in it.
        timed False: the step carried free drafts (a grammar's forced tokens), neither a plain step nor one of
        the policy's K: its time is not observed. wall: the step's wall seconds (propose, score,
        verify, commit), counted with its K = 0 evidence towards the measured rate of its arm (measured.py)."""
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
        drafted = sum(d.drafted for d in done if d is not None)
        tokens = len(rows) + sum(d.accepted for d in done if d is not None)
        # a step whose drafts were a grammar's forced tokens is no choice of K (they are drafted whatever K is):
        # a constrained row's arms are its plain steps and its drafting steps, masks at every position included
        if plan.arm is not None and wall is not None and timed and plan.chosen and all(d is not None for d in done):
            wall += sum(r.shadow.seconds for r in rows) - evidence
            self.estimates.rates.observe(plan.arm, plan.k, tokens, wall, most=len(rows) + drafted,
                                         level=self.estimates.costs.cost(len(rows), 1))
        if not timed:
            return
        self.choice.observe_step(len(rows), drafted, seconds, tokens, chosen=plan.chosen, catchup_s=catchup_s)

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


    def _shadow(self, r: Row, d: RowStep, plan: StepPlan, i: int) -> None:
        """Evidence at K = 0 (shadow.py): a plain step's cheap proposal kept to compare with the tokens to come, a
        draft model's guesses scored every SHADOW_CHUNK tokens; what is now known counted as drafting would be."""
        st, req, method, bursty = r.shadow, r.req, r.req.stats.method, r.proposer.bursty
        if d.drafted:
            forget(st)
        plain = not plan.asked[i] and not d.drafted
        if plain and plan.early.get(i) is not None:
            p = plan.early[i]
            keep_cheap(st, len(req.tokens) - 1, p.tokens.tolist(), p.match)
        evidence = resolve_cheap(st, req.tokens) if st.pending else []
        if plain and r.proposer.shadows and r.cap > 0 and st.seconds > SHADOW_SHARE * req.stats.decode_s:
            # past its share of the row's decoding, a step gathers nothing; what was scored and not yet counted is
            # dropped, so the scored positions stay contiguous when it resumes
            forget(st)
        elif plain and r.proposer.shadows and r.cap > 0:
            if req.verifier == "rejection" and d.logits is not None:
                t0 = time.perf_counter()
                keep_probs(st, len(req.tokens) - 1, r.proc.probs(d.logits[-1:])[0])
                dt = time.perf_counter() - t0
                st.seconds += dt
                req.stats.shadow_s += dt
                req.stats.decode_s += dt
            lag = r.proposer.lag(len(req.tokens))
            # a long catching up (a prompt) waits until it fits, with the evidence's seconds so far, within
            # SHADOW_BUDGET of the row's decoding so far, and within that share of what the request has left; a
            # constrained row keeps every scoring within that share (its grammar's forced tokens fill a chunk of
            # guesses in a few steps, so its scorings come several times as often per plain step)
            now = self.catchup_now_s(r) if lag > 2 * SHADOW_CHUNK else 0.0
            affordable = (lag <= 2 * SHADOW_CHUNK and req.grammar is None) or (
                st.seconds + now <= SHADOW_BUDGET * req.stats.decode_s
                and now <= SHADOW_BUDGET * tokens_left(req) * self.estimates.costs.cost(1, 1))
            # not on a row's first step: like its drafts, its catching up waits until the first token is out
            if lag > SHADOW_CHUNK and affordable and req.stats.target_forwards > 1:
                before = st.seconds
                score_guesses(st, r.proposer, req, r.proc, req.verifier)
                req.stats.shadow_s += st.seconds - before
                req.stats.decode_s += st.seconds - before
            evidence += [(passed, None) for passed in resolve_guesses(st, r.cap)]
        for passed, match in evidence:
            r.acceptance.observe_expected(passed, match)
            self.estimates.observe_expected(method, passed, match, bursty, r.band)


def arm_class(rows: list[Row]) -> tuple:
    """The arm class of a step over these rows (measured.py): their methods and temperature bands (greedy or
    sampled, structured or free) and their rows bucket."""
    return tuple(sorted({(r.req.stats.method, r.band) for r in rows})), rows_bucket(len(rows))


def tokens_left(req) -> int:
    """The tokens a request is expected to have left, what a draft model's catching up paid at once is weighed
    against: its budget (max_new_tokens less its output), or for a constrained request at most as many as it has
    produced so far. A grammar usually ends its request long before the budget (13-74 tokens of 96 on the
    structured workloads), and weighed against the budget a short constrained request fed its prompt to the draft
    for evidence and probes that its few remaining steps could not repay."""
    if req.grammar is None:
        return req.remaining
    return max(1, min(req.remaining, len(req.tokens) - len(req.prompt_ids)))


def _drafting_rows(rows: list[Row]) -> dict[str, int]:
    """method -> rows that would draft together in this step (a group's cost per token depends on it)."""
    out: dict[str, int] = {}
    for r in rows:
        if r.proposer is not None and r.proposer.group is not None:
            out[r.req.stats.method] = out.get(r.req.stats.method, 0) + 1
    return out

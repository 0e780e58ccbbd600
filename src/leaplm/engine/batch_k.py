"""Which rows of a batched step draft. The K policy (kpolicy/policy.py) plans one K for the step; in a batch whose rows
run several (method, band) groups (a mixed arm class: measured.per_group), each group drafts only where its own
measured rate at this batch size pays, and its rows decode plainly in the same steps where it does not (a step
with ragged K). A batch of one group is the policy's own class: the bandit there drops the whole batch to K = 0
when drafting at its rows bucket measures below plain decoding, and nothing here changes its plan.

  group        the rows of one (method, band) that draft under the policy (not a fixed-K row, nor a row without a
               proposer)
  group class  (((method, band),), rows bucket): the arm class measured.RateBandit keeps for a batch of that group
               alone (policy.arm_class), so a batch of one method measures it through the policy, and each step of
               a mixed batch measures each of its groups here: the group's committed tokens over its share (n_g / n)
               of the step's wall seconds, at the arm of the longest draft its rows were asked for
  decide       before the policy plans a mixed step, each group's K is the bandit's decision over its class given
               the group's cap (a K measured below plain decoding beyond the noise is abandoned, plain decoding is
               kept measured, an abandoned K is re-tried after a wait); the rows of a group at 0 are the policy's
               `free` rows (priced and asked nothing), so its one K is chosen over the groups that draft; when
               every group is at 0 the whole step decodes plainly
  refusal      a group not measured to pay that the policy's one K refused with (K = 0 over it and the others: its
               acceptance or its proposer's cost priced as a loss) sits the next steps out, the wait doubling from
               RETRY to MAX_RETRY; else it would hold every group of the batch at K = 0, and on a re-try or before
               it is measured it cannot be judged without drafting

Why per group and not per row: a row's own drafting moves the step's wall time by a fraction a single step cannot
resolve (the forward is shared), while a group's share is measured over many steps like any arm. It only chooses
which rows draft: what is accepted is the verifier's, so the output is the same whatever it decides.
"""
from __future__ import annotations

from dataclasses import dataclass

from .kpolicy.estimates import Estimates, rows_bucket
from .kpolicy.measured import MAX_RETRY, RETRY, per_group
from .kpolicy.policy import RowStep, StepPlan, arm_class
from .row import Row

Group = tuple[str, str]          # (method, band)


def group_of(r: Row) -> Group | None:
    """The row's group, None when it does not draft under the policy (no proposer, or a fixed K)."""
    if r.proposer is None or r.fixed_k:
        return None
    return r.req.stats.method, r.band


def group_class(g: Group, n: int) -> tuple:
    """The measured rates' key of group g in a batch of n rows (the arm class of a batch of g alone)."""
    return (g,), rows_bucket(n)


@dataclass
class GroupStep:
    """What one group did in a step, as its class counts it."""
    k: int                  # the longest draft its rows were asked for (0: its rows decoded plainly)
    rows: int
    tokens: int             # committed by its rows
    most: int               # ... had every draft been accepted


class BatchK:
    """Per-group decisions around the policy's plan (see the module docstring); the rates are the engine's
    (estimates.rates), shared with the policy."""

    def __init__(self, estimates: Estimates, enabled: bool = True):
        self.estimates = estimates
        self.enabled = enabled
        self.steps = 0
        self._evidence = 0.0        # the rows' K = 0 evidence seconds when the step was planned (policy.observe
                                    # adds what it gathers in the step to the step's wall time; so does observe)
        self._chosen: dict[Group, int] = {}     # each drafting group's K in the step being planned (mixed batches)
        self._out: dict[Group, int] = {}        # group -> the step it sits out until (the policy refused with it)
        self._wait: dict[Group, int] = {}       # group -> its current sit-out (doubles after each refusal)

    def groups(self, rows: list[Row]) -> dict[Group, list[int]]:
        out: dict[Group, list[int]] = {}
        for i, r in enumerate(rows):
            g = group_of(r)
            if g is not None:
                out.setdefault(g, []).append(i)
        return out

    def plain_rows(self, rows: list[Row]) -> frozenset[int]:
        """Rows of a mixed batch whose group decodes plainly this step (its class's decision is K = 0, or it sits
        out a refusal): the policy prices and asks them nothing (its `free` rows), so its one K is chosen over the
        groups that draft. Empty for a batch of one group."""
        self.steps += 1
        self._evidence = sum(r.shadow.seconds for r in rows)
        self._chosen = {}
        if not self.enabled or not per_group(arm_class(rows)):
            return frozenset()
        plain = []
        for g, idx in self.groups(rows).items():
            cap = max(rows[i].cap for i in idx)
            sits_out = self._out.get(g, 0) > self.steps
            k = 0 if sits_out or not cap else self.estimates.rates.decide(group_class(g, len(rows)), cap)
            if k:
                self._chosen[g] = k
            else:
                plain += idx
        return frozenset(plain)

    def plan(self, rows: list[Row], plan: StepPlan) -> StepPlan:
        """The policy's plan with each drafting group's rows cut to its class's K; the step's K the longest draft
        still asked. When the policy's one K is 0 over groups that could draft, those not measured to pay sit the
        next steps out (the wait doubling, RETRY to MAX_RETRY): a group the cost model prices as a loss (its
        acceptance, its proposer's cost) would otherwise keep every group of the batch at K = 0, and on a re-try
        or before it is measured it cannot be judged without drafting. Among groups none of which is measured to
        pay, the one with the best measured gain stays."""
        if not self._chosen:
            return plan
        n = len(rows)
        if plan.k == 0:
            # groups the policy could have asked: a row past its first step (plain by design), with a proposal
            offered = [g for g, idx in self.groups(rows).items() if g in self._chosen and any(
                rows[i].req.stats.target_forwards and (i not in plan.early or plan.early[i] is not None)
                for i in idx)]
            unproven = [g for g in offered if not self.estimates.rates.pays(group_class(g, n))]
            if len(offered) > 1 and unproven:
                if len(unproven) == len(offered):    # none measured to pay: the best measured gain stays
                    unproven.remove(max(unproven, key=lambda g: self.estimates.rates.gain(group_class(g, n))))
                for g in unproven:
                    self._wait[g] = min(MAX_RETRY, 2 * self._wait.get(g, RETRY // 2))
                    self._out[g] = self.steps + self._wait[g]
            return plan
        asked = list(plan.asked)
        for g, idx in self.groups(rows).items():
            for i in idx:
                asked[i] = min(asked[i], self._chosen.get(g, asked[i]))
            if g in self._chosen and any(asked[i] for i in idx):
                self._wait.pop(g, None)              # drafted: its next refusal waits from RETRY again
        if asked == plan.asked:
            return plan
        return StepPlan(max(asked), asked, plan.early, plan.chosen, plan.arm)     # expected: of the policy's K, not this

    def observe(self, rows: list[Row], plan: StepPlan, done: list[RowStep | None], wall: float | None,
                timed: bool = True) -> None:
        """After the policy observed the step (its K = 0 evidence included): each group of a mixed step counted in
        its class. Under the policy's conditions: a step it measures (timed, its own K, every row ran)."""
        if (not self.enabled or plan.arm is None or wall is None or not timed or not plan.chosen
                or any(d is None for d in done) or not per_group(plan.arm)):
            return
        n = len(rows)
        wall += sum(r.shadow.seconds for r in rows) - self._evidence
        level = self.estimates.costs.cost(n, 1)
        for g, idx in self.groups(rows).items():
            s = group_step(idx, plan, done)
            self.estimates.rates.observe(group_class(g, n), s.k, s.tokens, wall * s.rows / n, most=s.most,
                                         level=level)

    def rates(self, g: Group, n: int) -> dict[int, float]:
        """Group g's measured committed tokens per second per K at n rows (the read API: RateBandit.rates)."""
        return self.estimates.rates.rates().get(group_class(g, n), {})


def group_step(idx: list[int], plan: StepPlan, done: list[RowStep]) -> GroupStep:
    """The rows idx's part of a step."""
    drafted = sum(done[i].drafted for i in idx)
    accepted = sum(done[i].accepted for i in idx)
    k = max(plan.asked[i] for i in idx) if drafted else 0
    return GroupStep(k, len(idx), len(idx) + accepted, len(idx) + drafted)

"""When the K policy probes: at K = 0 chosen for low acceptance nothing is learnt, so a step at K > 0 is tried now
and then. The schedule decides when, and keeps what probes cost within a budget of plain decoding's time.

One probe (a step at the K > 0 with the best predicted rate) follows probe_every * n steps after K fell to 0 (a
probe widens every row's block: n times rarer). While that K is predicted within `near` of plain decoding
(estimates that noise could have pushed below break-even) it keeps probing at that pace; further below, the wait
doubles after each probe, up to max_probe_every * n steps and to what keeps probes within probe_budget of plain
decoding's time (a proposer that rarely has a proposal is probed more often: its probes rarely cost); a probe that
would first pay a draft model's catching up at once beyond the budget of the plain steps its request has left
is not made (`defer`). A probe in
which no row had a proposal taught nothing and cost nothing: the next step probes again. A probe's measured loss
(its seconds in plain steps less the tokens it yielded per row) sets the shortest wait before the next, in the
near range and past max_probe_every too, so that probes stay within their budget whatever the prediction says.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ProbeSchedule:
    probe_every: int = 8
    max_probe_every: int = 64
    near: float = 0.15
    probe_budget: float = 0.02
    upside_budget_factor: float = 3.0  # a probe at the K that pays after a hit (bursty proposers) may cost more
    probe_decay: float = 0.7           # EMA of the measured probe loss (probes are few, their cost varies with K)
    loss: float | None = None          # EMA of a probe's measured loss, in plain steps (None: none measured yet)
    since: int = 0                     # steps at K = 0 since the last probe
    interval: int = 0                  # current steps between probes (per row); 0: probe_every
    probing: bool = False              # the last choice was a probe
    retry: bool = False                # the last probe found no proposal: probe at the next step
    measuring: bool = False            # the step now running is a probe with a proposal: its time is measured
    upside: bool = False               # ... probed at the K that pays after a hit (bigger budget)

    def drafting(self, n: int) -> None:
        """The policy chose K > 0 on its prediction: the next stretch at K = 0 starts from the shortest wait."""
        self.since, self.retry = 0, False
        self.interval = max(self.probe_every, self.wait(n))

    def due(self, n: int) -> bool:
        """One more step at K = 0 over n rows: is a probe due?"""
        self.interval = self.interval or self.probe_every
        self.since += 1
        return self.since >= self.interval * n or self.retry

    def due_next(self, n: int) -> bool:
        """Would the next step at K = 0 over n rows be a probe (due() without counting the step)?"""
        return self.since + 1 >= (self.interval or self.probe_every) * n or self.retry

    def defer(self, n: int) -> None:
        """A probe due now would first pay more than its budget at once (a draft model's catching up on a long
        context): not now, asked again after the current wait (the wait itself is not lengthened: the schedule
        outlives the request, and the next request's first probe must not wait for this one's context)."""
        self.since = 0

    def start(self, n: int, cost: float, near: bool, upside: bool) -> None:
        """A probe runs now; cost: what it is expected to cost, in steps of plain decoding beyond one."""
        budget = self.probe_budget * (self.upside_budget_factor if upside else 1)
        longest = min(self.max_probe_every, max(self.probe_every, round(cost / budget / n)))
        self.since, self.retry = 0, False
        self.upside = upside
        self.interval = max(self.probe_every if near else min(2 * self.interval, longest), self.wait(n))
        self.probing = True

    def wait(self, n: int) -> int:
        """Steps between probes (per row) that keep the measured probe loss within the budget (0: none measured
        or probes do not lose)."""
        if self.loss is None or self.loss <= 0:
            return 0
        budget = self.probe_budget * (self.upside_budget_factor if self.upside else 1)
        return math.ceil(self.loss / budget / n)

    def proposed(self, any_proposal: bool) -> None:
        """After the step's proposals: a probe without any proposal is retried at the next step (no back-off)."""
        if self.probing and not any_proposal:
            self.retry = True
        self.measuring = self.probing and any_proposal
        self.probing = False

    def measured(self, n: int, seconds: float, tokens: int, plain_s: float) -> None:
        """A probe with a proposal took `seconds` and yielded `tokens` over n rows; plain_s: a plain step's."""
        loss = seconds / plain_s - tokens / n
        d = self.probe_decay
        self.loss = loss if self.loss is None else d * self.loss + (1 - d) * loss
        if self.interval:                # the wait already running follows what this probe cost
            self.interval = max(self.interval, self.wait(n))

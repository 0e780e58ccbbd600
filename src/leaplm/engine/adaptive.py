"""Adaptive K, the one K policy: choose each step's K from measured costs and measured acceptance, down to 0
(no speculation) when speculating would be slower than plain decoding. A single request is a batch of one.

Acceptance is estimated per row and conditional on the proposer having a proposal: an n-gram or suffix proposer
finds a match on some steps and none on others, and a step without one costs a one-token forward and teaches
nothing about how good its matches are. So a row's expected tokens at K are 1 + match * (G(K)), where match is
how often it had a proposal and G(K) the expected accepted tokens of a proposal cut at K, measured per draft
position; the step's cost is the wide forward only when some row has a proposal. Target costs per (rows, block
length) are engine/costs.py's: a level that follows the load times a shape measured pairwise at start-up.
Proposer costs and per-method acceptance live in `Estimates`.

Cheap proposers (n-gram, suffix: a proposal costs next to nothing) propose before K is chosen, at their row's
cap. Whether a row has a proposal is then known (match 1 or 0), its length caps the row's K, and its context
match length (how many tokens before the matched n-gram agree too: a long match is a copying stretch, a short one
a guess) selects the acceptance estimate: `AcceptanceEstimate` keeps one per match-length bucket. The proposal's
cost is then spent whatever K is chosen, so it is not charged.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .costs import BatchCostModel  # noqa: F401  (re-exported: the policy's cost model)


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


# With n rows verified in one forward of n x (K + 1) tokens, the step's K maximises the batch's token rate
#   sum_i (1 + m_i G_i(k_i)) / (E[cost(n, 1 + the longest k_i among rows that have a proposal)]
#                               + sum_i [m_i k_i propose_s_i + catchup_i])
# where k_i = min(K, cap_i), cap_i is row i's own K (0 for a row that does not speculate), m_i how often row i's
# proposer has a proposal, G_i its expected accepted tokens given one, and catchup_i (only for rows that draft)
# a draft model's prefill of unseen tokens spread over the request's remaining steps; K > 0 must beat K = 0 by
# min_gain. As n grows the forward turns compute-bound, cost(n, K + 1) outgrows the tokens it buys and K falls
# to 0: speculation never makes a full batch slower than plain decoding.


@dataclass
class Counts:
    """EMA-weighted acceptance counts of proposal steps: a per-token rate (prior 0.8) and, per draft position i,
    how often a step that asked for at least i + 1 tokens had its first i + 1 accepted."""
    accepted: float = 4.0
    rejected: float = 1.0
    asked: list[float] = field(default_factory=list)     # [K] EMA weight of proposal steps asking >= i + 1 tokens
    passed: list[float] = field(default_factory=list)    # [K] of those, steps whose first i + 1 were accepted

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def scaled(self, strength: float) -> "Counts":
        """The same estimate worth at most `strength` steps."""
        rate = self.rate
        scale = strength / max(strength, self.asked[0]) if self.asked else 0.0
        return Counts(strength * rate, strength * (1 - rate), [w * scale for w in self.asked],
                      [w * scale for w in self.passed])

    def observe(self, drafted: int, accepted: int, asked: int, d: float) -> None:
        grow = asked - len(self.asked)
        if grow > 0:
            self.asked += [0.0] * grow
            self.passed += [0.0] * grow
        self.asked = [d * w + (1.0 if i < asked else 0.0) for i, w in enumerate(self.asked)]
        self.passed = [d * w + (1.0 if i < accepted else 0.0) for i, w in enumerate(self.passed)]
        self.accepted = d * self.accepted + accepted
        self.rejected = d * self.rejected + (1 if accepted < drafted else 0)

    def tokens_by_k(self, cap: int, prior_weight: float) -> list[float]:
        """Expected tokens of a step with a proposal asking for k = 0..cap drafts (1 at k = 0): 1 + sum over i < k
        of P(first i + 1 accepted). Each position's measured frequency is smoothed towards the previous position's
        estimate times the per-token rate (prior_weight pseudo-steps), which is all there is where no step asked
        that far."""
        out, total, prob, a = [1.0], 1.0, 1.0, self.rate
        for i in range(cap):
            est = prob * a
            if i < len(self.asked):
                est = (self.passed[i] + prior_weight * est) / (self.asked[i] + prior_weight)
            prob = min(prob, est)
            total += prob
            out.append(total)
        return out


MATCH_BUCKETS = 6     # context match lengths 1, 2, 3-4, 5-8, 9-16, 17+


def match_bucket(match: int) -> int:
    """A proposal's context match length (tokens) -> its acceptance bucket (0 .. MATCH_BUCKETS - 1)."""
    return min(MATCH_BUCKETS - 1, max(0, match - 1).bit_length())


@dataclass
class AcceptanceEstimate:
    """One request's acceptance given that its proposer had a proposal, and apart, how often it had one (`match`).
    A step where it had none changes only `match`: it cost nothing beyond a one-token forward and says nothing
    about the proposals it does make.

    Given a proposal, the counts are kept in two states, after a proposal whose first token was accepted and after
    one whose first token was not, and the current state's are used: an n-gram proposer is bursty (while the
    output copies earlier text its matches are right for many tokens, elsewhere they are mostly wrong), and the
    last outcome tells which stretch a row is in. For a proposer whose acceptance does not depend on the last
    outcome (a draft model) both states measure the same thing."""
    decay: float = 0.95
    after_hit: Counts = field(default_factory=Counts)
    after_miss: Counts = field(default_factory=Counts)
    hit: bool = True                                     # the last proposal's first token was accepted
    proposed: float = 1.0                                # EMA weight of steps that asked and got a proposal
    empty: float = 0.0                                   # ... and of those that got none
    prior_weight: float = 3.0                            # pseudo-steps behind each position's extrapolated prior
    # match bucket -> counts of proposals known before K was chosen (cheap proposers), see the module docstring
    by_match: dict[int, Counts] = field(default_factory=dict)

    @classmethod
    def seeded(cls, seen: "AcceptanceEstimate", strength: float = 5.0) -> "AcceptanceEstimate":
        """A new request's estimate, starting from what its method has measured on earlier requests (worth at
        most `strength` steps) instead of the fixed prior: a full batch keeps admitting new rows, and an
        optimistic prior on each would keep buying drafts that the measured acceptance does not pay for."""
        match = seen.match
        return cls(after_hit=seen.after_hit.scaled(strength), after_miss=seen.after_miss.scaled(strength),
                   hit=seen.hit, proposed=strength * match, empty=strength * (1 - match),
                   by_match={b: c.scaled(strength) for b, c in seen.by_match.items()})

    @property
    def counts(self) -> Counts:
        return self.after_hit if self.hit else self.after_miss

    @property
    def rate(self) -> float:
        """Per-token acceptance given a proposal, in the current state."""
        return self.counts.rate

    @property
    def match(self) -> float:
        """How often the proposer had a proposal when asked."""
        return self.proposed / (self.proposed + self.empty)

    def observe(self, drafted: int, accepted: int, asked: int | None = None, match: int | None = None,
                known: bool = False) -> None:
        """A step asked for `asked` tokens (default: drafted), the proposer drafted `drafted` (0: it had nothing),
        `accepted` kept. known: the proposal was made before K was chosen (observe_match counted it), of context
        match length `match` (None: unknown)."""
        asked = drafted if asked is None else asked
        if asked <= 0:
            return
        d = self.decay
        if not known:
            self.observe_match(drafted > 0)
        if drafted:
            if match is not None:
                self.match_counts(match).observe(drafted, accepted, asked, d)
            self.counts.observe(drafted, accepted, asked, d)
            self.hit = accepted > 0

    def observe_match(self, had: bool) -> None:
        """The proposer was asked and had a proposal (or not)."""
        d = self.decay
        self.proposed = d * self.proposed + (1.0 if had else 0.0)
        self.empty = d * self.empty + (0.0 if had else 1.0)

    def match_counts(self, match: int) -> Counts:
        """The counts of proposals of this context match length. A new bucket starts from the optimistic prior,
        not from the current state: after a stretch of wrong short matches the first long one must still be
        tried (simulated: starting from the state's estimate lost up to 27% against the best fixed K)."""
        return self.by_match.setdefault(match_bucket(match), Counts())

    def tokens_by_k(self, cap: int, match: int | None = None) -> list[float]:
        """[cap + 1] expected tokens of a step with a proposal at each K: in the current state, or given a proposal
        in hand of context match length `match` (by_match_length)."""
        if match is None:
            return self.counts.tokens_by_k(cap, self.prior_weight)
        return self.by_match_length(cap, match_bucket(match))

    def by_match_length(self, cap: int, bucket: int) -> list[float]:
        """[cap + 1] expected tokens given a proposal of this match bucket, assuming a longer match is never worse:
        buckets whose estimates say otherwise are pooled (pool-adjacent-violators on the tokens at `cap`, each
        weighted by its proposals). Each bucket sees few proposals, a few unlucky ones would price a bucket out,
        and at K = 0 it learns nothing more (simulated: 0.90 of the best fixed K without pooling, 0.97 with)."""
        blocks: list[list] = []                        # [weighted curves summed, weight, buckets] of pooled runs
        for b in sorted(set(self.by_match) | {bucket}):
            c = self.by_match.get(b, Counts())
            w = 1.0 + (c.asked[0] if c.asked else 0.0)
            blocks.append([[w * t for t in c.tokens_by_k(cap, self.prior_weight)], w, [b]])
            while len(blocks) > 1 and blocks[-2][0][-1] / blocks[-2][1] > blocks[-1][0][-1] / blocks[-1][1]:
                curve, w, members = blocks.pop()
                blocks[-1][0] = [a + t for a, t in zip(blocks[-1][0], curve)]
                blocks[-1][1] += w
                blocks[-1][2] += members
        curve, w, _ = next(blk for blk in blocks if bucket in blk[2])
        return [t / w for t in curve]

    def tokens_by_k_after_hit(self, cap: int) -> list[float]:
        return self.after_hit.tokens_by_k(cap, self.prior_weight)


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
class BatchAdaptiveK:
    """Chooses the K of each batched step from measured forward costs and per-row acceptance (see above).

    At K = 0 chosen for low acceptance (not for cost: when even perfect acceptance would not pay at this batch
    size, drafting a token would only cost) nothing is learnt, so it re-probes: one step at the K > 0 with the
    best predicted rate, probe_every * n steps after K fell to 0 (a probe widens every row's block: n times
    rarer). While that K is predicted within `near` of plain decoding (estimates that noise could have pushed
    below break-even) it keeps probing at that pace; further below, the wait doubles after each probe, up to
    max_probe_every * n steps and to what keeps probes within probe_budget of plain decoding's time (a proposer
    that rarely has a proposal is probed more often: its probes rarely cost). A probe in which no row had a
    proposal taught nothing and cost nothing: the next step probes again (the Batch reports it through probed()).

    Every step is measured too (observe_step, from the Batch). The prediction prices chain forwards and a
    proposal per drafted token; a tree proposal (several head levels whatever K, the seed's race over the
    vocabulary at each node), its tree-masked forward, or a head catching up on the context it skipped at K = 0
    cost more, and with K ~ 0 on the embedded target the head methods ran at 0.87-0.97x plain decoding. So:
    drafting is priced at its predicted seconds times the measured overrun (measured / predicted seconds of steps
    that drafted, over the same of plain steps, at least 1); and a probe's measured loss (its seconds in plain
    steps less the tokens it yielded per row) sets the shortest wait before the next, in the near range and past
    max_probe_every too, so that probes stay within their budget whatever the prediction says."""
    costs: BatchCostModel
    enabled: bool = True
    probe_every: int = 8
    max_probe_every: int = 64
    near: float = 0.15
    probe_budget: float = 0.02
    upside_budget_factor: float = 3.0
    # A batch drafts only when the model predicts at least this gain over K = 0: near the break-even point (a
    # filling batch) the prediction rests on costs measured at other contexts and loads, and a wrong call there
    # makes the server slower than plain decoding; a small margin buys "never slower" for little.
    min_gain: float = 0.03
    probe_decay: float = 0.7       # EMA of the measured probe loss (probes are few, their cost varies with K)
    probing: bool = False          # the last choice was a probe
    _since_probe: int = 0
    _interval: int = 0             # current steps between probes (per row); 0: probe_every
    _retry: bool = False           # the last probe found no proposal: probe at the next step
    _measure: bool = False         # the step now running is a probe with a proposal: observe_step measures it
    _upside: bool = False          # ... probed at the K that pays after a hit (bigger budget)
    plain_s: dict[int, float] = field(default_factory=dict)    # n -> EMA of a K = 0 step's seconds over n rows
    probe_loss: float | None = None  # EMA of a probe's measured loss, in plain steps: its seconds / plain - its
                                     # tokens per row (None: no probe measured yet)
    # EMAs of measured / predicted seconds of steps that drafted and of plain steps; their ratio, the overrun (at
    # least 1, once 3 drafting steps are measured), scales the predicted seconds of drafting, which the model
    # prices from chain forwards and a cost per drafted token
    overrun_slack: float = 0.05    # what the ratio of the two noisy EMAs shows of noise alone: not charged
    _over_draft: float | None = None
    _over_plain: float | None = None
    _drafting_steps: int = 0
    overrun: float = 1.0
    _predicted: float = 0.0        # the predicted seconds of the step now running (its chosen K, proposals made)
    _chosen: int = 0               # ... and its K

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
        self._chosen = K
        return K

    def _choose(self, rows: list[RowSpec]) -> int:
        self.probing = False
        k_max = max((r.cap for r in rows), default=0)
        if k_max == 0:
            return 0
        if not self.enabled:
            return k_max
        K = self.best(rows)
        if K > 0:
            self._since_probe, self._retry = 0, False
            self._interval = max(self.probe_every, self._measured_wait(len(rows)))
            return K
        self._interval = self._interval or self.probe_every
        self._since_probe += 1
        if self._since_probe < self._interval * len(rows) and not self._retry:
            return 0
        # checked only when a probe is due (a step at K = 0 should cost next to nothing)
        perfect = [dataclasses.replace(r, acceptance=1.0, tokens_by_k=None, match=1.0) for r in rows]
        if self.best(perfect) == 0:
            return 0
        rates = {k: self.rate(rows, k) for k in range(1, k_max + 1)}
        probe = max(rates, key=rates.get)
        plain = self.rate(rows, 0)
        near = rates[probe] >= plain * (1 - self.near)
        n = len(rows)
        # a proposer that is good after a hit (bursty: n-gram) earns a bigger budget and a probe at the K that
        # pays after a hit: a probe that hits finds a stretch where drafting pays, and waiting would miss it
        hit = [dataclasses.replace(r, tokens_by_k=r.tokens_by_k_after_hit) for r in rows
               if r.tokens_by_k_after_hit is not None]
        upside = self.best(hit) if len(hit) == n else 0
        probe = upside or probe
        # what a probe is expected to cost, in steps of plain decoding: the longest wait keeps probes within
        # probe_budget of plain decoding's time (a probe of a proposer that rarely has a proposal rarely costs)
        cost = self._step_seconds(rows, probe) / self.costs.cost(n, 1) - 1.0
        budget = self.probe_budget * (self.upside_budget_factor if upside else 1)
        longest = min(self.max_probe_every, max(self.probe_every, round(cost / budget / n)))
        self._since_probe, self._retry = 0, False
        self._upside = bool(upside)
        self._interval = max(self.probe_every if near else min(2 * self._interval, longest), self._measured_wait(n))
        self.probing = True
        return probe

    def _measured_wait(self, n: int) -> int:
        """Steps between probes (per row) that keep the measured probe loss within the budget (0: none measured
        or probes do not lose)."""
        if self.probe_loss is None or self.probe_loss <= 0:
            return 0
        budget = self.probe_budget * (self.upside_budget_factor if self._upside else 1)
        return math.ceil(self.probe_loss / budget / n)

    def probed(self, any_proposal: bool) -> None:
        """After a probe's propose: when no row had a proposal, probe again at the next step (no back-off)."""
        if self.probing and not any_proposal:
            self._retry = True
        self._measure = self.probing and any_proposal
        self.probing = False

    def observe_step(self, n: int, drafted: int, seconds: float, tokens: int, chosen: bool = True,
                     catchup_s: float = 0.0) -> None:
        """A step over n rows that drafted `drafted` tokens (all rows) took `seconds` (catchup_s of them a draft
        model catching up) and yielded `tokens`: a plain step is the reference; a probe's loss against it sets the
        shortest wait before the next one. chosen: the step ran the K this policy chose (not one forced by fixed-K
        rows), so its prediction is comparable."""
        if chosen and self._predicted > 0 and (drafted > 0) == (self._chosen > 0):   # a K > 0 without proposals:
            over = max(0.0, seconds - catchup_s) / self._predicted                       # neither
            if drafted:
                self._over_draft = _ema(self._over_draft, over)
                self._drafting_steps += 1
            else:
                self._over_plain = _ema(self._over_plain, over)
            if self._drafting_steps >= 3:
                self.overrun = max(1.0, self._over_draft / (self._over_plain or 1.0) - self.overrun_slack)
        if not drafted:
            old = self.plain_s.get(n)
            self.plain_s[n] = seconds if old is None else 0.9 * old + 0.1 * seconds
        elif self._measure and chosen:
            plain = self.plain_s.get(n) or self.costs.cost(n, 1)
            loss = seconds / plain - tokens / n
            d = self.probe_decay
            self.probe_loss = loss if self.probe_loss is None else d * self.probe_loss + (1 - d) * loss
            if self._interval:           # the wait already running follows what this probe cost
                self._interval = max(self._interval, self._measured_wait(n))
        self._measure = False


def _ema(old: float | None, x: float, d: float = 0.9) -> float:
    """An EMA of measured / predicted seconds; a sample counts at most twice the estimate (one step slowed by
    another process must not price drafting out: at K = 0 only rare probes would bring it back)."""
    x = min(x, 2.0 * (old or 1.0))
    return x if old is None else d * old + (1 - d) * x


def rows_bucket(n: int) -> int:
    """n rounded up to a power of two (costs measured at 5 rows stand for 5..8)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass
class Estimates:
    """What an engine has measured, shared by every batch it runs (the one cost calibration): batched forward
    costs, proposer seconds per drafted token and acceptance per method, a draft model's prefill cost."""
    costs: BatchCostModel = field(default_factory=BatchCostModel)
    propose_s: dict[str, float] = field(default_factory=dict)       # method -> EMA of seconds per drafted token
    # (method, rows bucket) -> the same, for proposers that draft for many rows at once (the draft model): its
    # forward over n rows costs far less than n forwards, so its cost per drafted token depends on n
    propose_s_rows: dict[tuple[str, int], float] = field(default_factory=dict)
    # method -> acceptance over all its requests (slow EMA): the starting estimate of a new request's row
    method_acceptance: dict[str, AcceptanceEstimate] = field(default_factory=dict)
    draft_prefill_s_per_token: float = 0.0
    calibrated_rows: set[int] = field(default_factory=set)          # batch sizes step.calibrate has measured

    def observe_propose(self, method: str, seconds_per_token: float, rows: int | None = None) -> None:
        """rows: how many rows drafted together (None: a proposer that drafts row by row)."""
        old = self.propose_s.get(method)
        self.propose_s[method] = seconds_per_token if old is None else 0.9 * old + 0.1 * seconds_per_token
        if rows is not None:
            key = (method, rows_bucket(rows))
            old = self.propose_s_rows.get(key)
            self.propose_s_rows[key] = seconds_per_token if old is None else 0.9 * old + 0.1 * seconds_per_token

    def propose_cost(self, method: str, rows: int) -> float:
        """Seconds per drafted token of `method` when `rows` rows draft in one step."""
        by_rows = self.propose_s_rows.get((method, rows_bucket(rows)))
        return by_rows if by_rows is not None else self.propose_s.get(method, 0.0)

    def acceptance(self, method: str) -> AcceptanceEstimate:
        """`method`'s acceptance over all its requests (created on first use)."""
        return self.method_acceptance.setdefault(method, AcceptanceEstimate(decay=0.98))

    def observe_acceptance(self, method: str, drafted: int, accepted: int, asked: int | None = None,
                           match: int | None = None, known: bool = False) -> None:
        """A step of a row of `method` (drafted 0: its proposer had nothing to propose)."""
        self.acceptance(method).observe(drafted, accepted, asked, match, known)

"""Acceptance estimates of the K policy: how many tokens a step with a proposal of k drafts is expected to yield.

Acceptance is estimated per row and conditional on the proposer having a proposal: an n-gram or suffix proposer
finds a match on some steps and none on others, and a step without one costs a one-token forward and teaches
nothing about how good its matches are. So a row's expected tokens at K are 1 + match * G(K), where match is how
often it had a proposal and G(K) the expected accepted tokens of a proposal cut at K, measured per draft position.
A cheap proposer's proposal is in hand before K is chosen; its context match length (how many tokens before the
matched n-gram agree too: a long match is a copying stretch, a short one a guess) selects the estimate:
`AcceptanceEstimate` keeps one per match-length bucket.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)



@dataclass
class Counts:
    """EMA-weighted acceptance counts of proposal steps: a per-token rate (prior 0.8) and, per draft position i,
    how often a step that asked for at least i + 1 tokens had its first i + 1 accepted."""
    accepted: float = 4.0
    rejected: float = 1.0
    asked: list[float] = field(default_factory=list)     # [K] EMA weight of proposal steps asking >= i + 1 tokens
    passed: list[float] = field(default_factory=list)    # [K] of those, steps whose first i + 1 were accepted
    # tokens_by_k's curves since the last observation: the policy prices every row at every step, mostly from
    # counts no step changed (a bucket of match lengths the row's proposals do not reach)
    _curves: dict = field(default_factory=dict, repr=False, compare=False)

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
        self.observe_expected([1.0] * accepted + [0.0] * (asked - accepted), d, float(accepted < drafted))

    def observe_expected(self, passed: list[float], d: float, rejected: float | None = None) -> None:
        """A step that asked (or would have asked) len(passed) drafts, passed[i] the probability that its first
        i + 1 were accepted (1 or 0 where the outcome is known; counterfactual evidence gathered at K = 0:
        shadow.py). rejected: whether a draft was rejected (default: the last position did not pass)."""
        self._curves.clear()
        asked = len(passed)
        grow = asked - len(self.asked)
        if grow > 0:
            self.asked += [0.0] * grow
            self.passed += [0.0] * grow
        self.asked = [d * w + (1.0 if i < asked else 0.0) for i, w in enumerate(self.asked)]
        self.passed = [d * w + (passed[i] if i < asked else 0.0) for i, w in enumerate(self.passed)]
        self.accepted = d * self.accepted + sum(passed)
        self.rejected = d * self.rejected + (1.0 - passed[-1] if rejected is None else rejected)

    def tokens_by_k(self, cap: int, prior_weight: float, carry: bool = False) -> list[float]:
        """Expected tokens of a step with a proposal asking for k = 0..cap drafts (1 at k = 0): 1 + sum over i < k
        of P(first i + 1 accepted). Each position's measured frequency is smoothed (prior_weight pseudo-steps)
        towards the previous position's estimate times a continuation rate, which is all there is where no step
        asked that far: the per-token rate up to the second position, then (carry) the conditional acceptance
        measured at the deepest position asked so far. Why: a draft that has its first tokens right tends to stay
        right (on the embedded target its draft keeps 0.80-0.91 of positions 4-5 given the ones before, where its
        per-token rate, first positions' misses included, is 0.71); priced at the per-token rate, the positions
        a short K never reaches stay under-priced, and the policy never asks them. carry=False: the per-token rate
        throughout (for comparison)."""
        key = (cap, prior_weight, carry, self.accepted, self.rejected)     # a prior set on a new one included
        if key not in self._curves:
            self._curves[key] = self._tokens_by_k(cap, prior_weight, carry)
        return list(self._curves[key])

    def _tokens_by_k(self, cap: int, prior_weight: float, carry: bool) -> list[float]:
        out, total, prob, a = [1.0], 1.0, 1.0, self.rate
        cont = a
        for i in range(cap):
            est = prob * cont
            if i < len(self.asked):
                est = (self.passed[i] + prior_weight * est) / (self.asked[i] + prior_weight)
            nxt = min(prob, est)
            if carry and 1 <= i < len(self.asked) and self.asked[i] > 0 and prob > 0:
                cont = nxt / prob
            prob = nxt
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
    last outcome tells which stretch a row is in. A proposer that is not bursty (a draft model, a head: its
    acceptance does not follow from the last outcome) keeps one state, `after_hit`, for every step: split in two,
    each state held half the evidence and the wrong half (a full acceptance after a miss was counted in the
    after-miss state, then the after-hit state, holding the misses, was read), a row that missed early fell to
    K = 0 and stayed there, since at K = 0 the state no longer changes (measured on the embedded target's draft:
    95 of 96 steps at K = 0 after two early misses, 0.4x the speed of fixed K = 7)."""
    decay: float = 0.95
    bursty: bool = True                                  # two states (see above); False: one
    after_hit: Counts = field(default_factory=Counts)
    after_miss: Counts = field(default_factory=Counts)
    hit: bool = True                                     # the last proposal's first token was accepted
    proposed: float = 1.0                                # EMA weight of steps that asked and got a proposal
    empty: float = 0.0                                   # ... and of those that got none
    prior_weight: float = 3.0                            # pseudo-steps behind each position's extrapolated prior
    # match bucket -> counts of proposals known before K was chosen (cheap proposers), see the module docstring
    by_match: dict[int, Counts] = field(default_factory=dict)
    carry: bool = True                                   # a proposer that is not bursty: unasked positions at the
                                                         # deepest measured conditional rate (Counts.tokens_by_k)

    @classmethod
    def seeded(cls, seen: "AcceptanceEstimate", strength: float = 5.0) -> "AcceptanceEstimate":
        """A new request's estimate, starting from what its method has measured on earlier requests (worth at
        most `strength` steps) instead of the fixed prior: a full batch keeps admitting new rows, and an
        optimistic prior on each would keep buying drafts that the measured acceptance does not pay for."""
        match = seen.match
        return cls(after_hit=seen.after_hit.scaled(strength), after_miss=seen.after_miss.scaled(strength),
                   hit=seen.hit, bursty=seen.bursty, carry=seen.carry, proposed=strength * match,
                   empty=strength * (1 - match),
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
            self.hit = accepted > 0 or not self.bursty

    def observe_expected(self, passed: list[float], match: int | None = None) -> None:
        """What a proposal of len(passed) drafts would have kept, had the row drafted (it decoded plainly):
        passed[i] the probability that its first i + 1 drafts were accepted. match: a cheap proposer's context
        match length. Counted like a drafting step's outcome (shadow.py gathers it)."""
        if not passed:
            return
        if match is not None:
            self.match_counts(match).observe_expected(passed, self.decay)
        self.counts.observe_expected(passed, self.decay)
        self.hit = passed[0] >= 0.5 or not self.bursty

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

    @property
    def carries(self) -> bool:
        """Unasked positions priced at the deepest measured conditional rate (Counts.tokens_by_k): for a proposer
        that is not bursty. A bursty one's deeper positions are told apart by its two states and match buckets
        instead, and carrying its deepest conditional rate, noisy in each, lost up to 6% against the best fixed
        K in simulation (tests/engine/test_adaptive.py's n-gram-like proposer)."""
        return self.carry and not self.bursty

    def tokens_by_k(self, cap: int, match: int | None = None) -> list[float]:
        """[cap + 1] expected tokens of a step with a proposal at each K: in the current state, or given a proposal
        in hand of context match length `match` (by_match_length)."""
        if match is None:
            return self.counts.tokens_by_k(cap, self.prior_weight, self.carries)
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
            blocks.append([[w * t for t in c.tokens_by_k(cap, self.prior_weight, self.carries)], w, [b]])
            while len(blocks) > 1 and blocks[-2][0][-1] / blocks[-2][1] > blocks[-1][0][-1] / blocks[-1][1]:
                curve, w, members = blocks.pop()
                blocks[-1][0] = [a + t for a, t in zip(blocks[-1][0], curve)]
                blocks[-1][1] += w
                blocks[-1][2] += members
        curve, w, _ = next(blk for blk in blocks if bucket in blk[2])
        return [t / w for t in curve]

    def tokens_by_k_after_hit(self, cap: int) -> list[float] | None:
        """[cap + 1] tokens_by_k after a hit, for a bursty proposer (None: one state)."""
        return self.after_hit.tokens_by_k(cap, self.prior_weight, self.carries) if self.bursty else None

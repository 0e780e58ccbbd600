"""Measured rates: what each K actually delivered, in committed tokens per wall-second, and the bandit that lets
them overrule the cost model's choice.

The cost model (adaptive.py) prices a step from forward costs and acceptance; costs outside it (proposing, a
short block's verify, commits, the evidence gathered at K = 0, a grammar's masks at every drafted position) are
missed, and a drafting step it prices as a gain can lose wall time. So every step is also counted here:

  arm class  (the methods and temperature bands of the step's rows, its rows bucket): greedy and sampled,
             structured and free text, each method, are kept apart
  arm        the step's K (0: plain decoding; for a constrained row, decoding with its grammar's forced tokens
             only). A step whose drafts are all forced tokens is no choice of K and is not counted; a drafting
             step's time includes the grammar's masks at every drafted position
  rate       discounted committed tokens / discounted wall seconds of the steps that ran the arm, each arm
             discounted per step of its own: plain's by PLAIN_DECAY (its last steps decide), drafting's by DECAY

A busy machine does not switch speculation off: each step's seconds are counted in units of a one-token forward
at the load of the moment (the cost model's level, which every live forward refreshes: costs.py), so a burst of
other work slows both arms' steps and their units alike; and an arm is judged to lose only against a plain step
at most FRESH steps old (else a plain step is run first to confirm).

The bandit (`RateBandit.decide`) takes the cost model's K as its prior and:
  1. keeps plain decoding measured: while the model drafts, a K = 0 step runs when plain has fewer than 2
     measurements or none for PLAIN_EVERY steps of the class (PLAIN_EVERY_CLEAR when the K wins clearly)
  2. abandons an arm whose seconds lose on the tokens the model expected of it (ArmClass.costs_more: a cost the
     model misses), or that loses beyond the noise on fewer tokens than expected (its acceptance overrated):
     within MIN_STEPS steps once plain is measured, at once when even accepting every draft would not pay
  3. re-tries an abandoned arm after RETRY steps of its class, measured afresh, the wait doubling after each
     loss up to MAX_RETRY; an arm that now pays is taken back
  4. picks, among measured K > 0 arms, one that beats the model's K beyond the margin
  5. while the model says K = 0: takes an arm measured faster than plain where the model prices it within
     adaptive.NEAR of plain (both within the noise), and explores, one step of the model's best-priced K > 0
     (adaptive.BatchAdaptiveK.explore) RETRY steps into the stretch, then after waits doubling up to MAX_RETRY
     (not while priced near plain or with an upside). Why: at K = 0 a head learns nothing, and a draft's
     evidence (shadow.py) stops while drafting loses
Re-tries and explorations share one budget per class: none starts before the last has paid for its measured
loss within RETRY_BUDGET of plain decoding's time (ArmClass.tried).
A mixed class (rows of several methods or bands) is not decided here but per group (per_group).

It only chooses K: what is accepted is the verifier's.
`rates()` is the read API: the current rate per arm class and arm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .adaptive import Alternative

DECAY = 0.9              # per step of a drafting arm: its last 10 or so steps make its rate
PLAIN_DECAY = 0.4        # per plain step: the latest one weighs 60%, so a loss is judged against the present load
FRESH = 2                # a loss is judged only against a plain step at most this many steps of the class old
MIN_STEPS = 3            # measurements before an arm is judged by its mean
PRIOR_STEPS = 2          # the weight, in steps, of the prior on a drafting arm's spread (Arm.stderr)
MARGIN = 0.03            # the least relative gap that counts as a loss (noise a deterministic clock cannot show)
Z = 2.0                  # standard errors of the gap that count as noise
PLAIN_EVERY = 16         # steps of a drafting class between plain steps, near break-even
PLAIN_EVERY_CLEAR = 64   # ... while the model's K beats plain by more than CLEAR
CLEAR = 0.25
RETRY = 16               # steps of a class before an abandoned arm is tried again (doubles after each loss)
MAX_RETRY = 256
RETRY_BUDGET = 0.01      # re-tries and explorations cost at most this share of plain decoding's time
UPSIDE = 3.0             # ... times this for an exploration with an upside (adaptive.Alternative)
NO_ALTERNATIVE = Alternative(0, False)


@dataclass
class Arm:
    """Discounted sums of the steps that ran one K in one class (seconds in one-token forwards at the load of the
    moment)."""
    n: int = 0               # steps measured (not discounted: when the arm may be judged)
    steps: float = 0.0       # effective number of steps
    tokens: float = 0.0
    most: float = 0.0        # the tokens its steps could have committed had every draft been accepted
    expected: float = 0.0    # the tokens the cost model expected of its steps (from the acceptance estimates)
    drafts: float = 0.0      # the tokens its steps drafted (none: no row had a proposal)
    seconds: float = 0.0
    r1: float = 0.0          # sum of per-step rates (tokens / seconds)
    r2: float = 0.0          # ... of their squares (the noise margin)

    def decay(self, f: float) -> None:
        self.steps *= f
        self.tokens *= f
        self.most *= f
        self.expected *= f
        self.drafts *= f
        self.seconds *= f
        self.r1 *= f
        self.r2 *= f

    def add(self, tokens: float, most: float, seconds: float, expected: float, drafts: float) -> None:
        r = tokens / seconds
        self.n += 1
        self.steps += 1.0
        self.tokens += tokens
        self.most += most
        self.expected += expected
        self.drafts += drafts
        self.seconds += seconds
        self.r1 += r
        self.r2 += r * r

    @property
    def rate(self) -> float:
        """Committed tokens per second."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def stderr(self) -> float:
        """The standard error of the mean per-step rate; its variance is pulled towards a prior of a quarter of
        the steps' range (1 token to all drafts accepted) squared, worth PRIOR_STEPS steps: three sampled steps
        that each happened to yield one token have no spread, yet say little."""
        if self.n < 2 or self.steps <= 1.0:
            return math.inf
        mean = self.r1 / self.steps
        var = max(0.0, self.r2 / self.steps - mean * mean)
        spread = (self.most - self.steps) / self.seconds     # the most tokens beyond one a step, per second
        prior = (max(0.0, spread) / 4) ** 2
        var = (var * self.steps + prior * PRIOR_STEPS) / (self.steps + PRIOR_STEPS)
        return math.sqrt(var / (self.steps - 1))


@dataclass
class ArmClass:
    """One class's arms (K -> Arm) and its bandit state."""
    arms: dict[int, Arm] = field(default_factory=dict)
    steps: int = 0                   # steps observed
    level: float = 1.0               # the latest step's one-token forward seconds (the unit of the arms' seconds)
    since_plain: int = 0             # steps since the last plain step
    lost: dict[int, int] = field(default_factory=dict)    # abandoned K -> the class step it may be re-tried at
    wait: dict[int, int] = field(default_factory=dict)    # K -> its current re-try wait
    retrying: set[int] = field(default_factory=set)       # arms being re-measured after a loss
    costly: set[int] = field(default_factory=set)         # abandoned arms that lost on their seconds (costs_more)
    next_try: int = 0                # no re-try or exploration starts before this class step (RETRY_BUDGET)
    explore_at: int | None = None    # the class step of the next exploration at K = 0 (None: the model drafts)
    explore_wait: int = RETRY        # ... the current wait between explorations
    exploring: int = 0               # the K of the exploration now running (0: none)
    near: bool = False               # ... priced near plain (adaptive.Alternative)
    upside: bool = False             # ... with an upside

    def arm(self, k: int) -> Arm:
        return self.arms.setdefault(k, Arm())

    def loses(self, k: int) -> bool:
        """costs_more(k), or arm k measured below plain beyond the noise on fewer tokens than the model expected
        of it (its acceptance overrated). Not on one step's tokens: a sampled step that drafts well on average
        often yields one token. Not on tokens the model expected: a copying proposer's K follows its state (after
        a hit, after a miss) and its proposals' match lengths, and its steps after a lucky hit in fresh text
        lose as expected, which says nothing of the next copying stretch."""
        a, p = self.arms.get(k), self.arms.get(0)
        if a is None or p is None or a.n < 1 or p.n < 1:
            return False
        return self.costs_more(k) or (a.n >= MIN_STEPS and a.rate < p.rate - gap(a, p)
                                      and a.tokens < (1 - MARGIN) * a.expected)

    def costs_more(self, k: int) -> bool:
        """Arm k's seconds lose against plain on the tokens its steps were expected to yield (the acceptance
        estimates: a mean over many steps, where its committed tokens are a few noisy ones), or at once on every
        draft accepted (a draft slower than the target loses at its first step). Why: a cost the model does not
        see (a tree's head levels, a head catching up, a calibration from a busy moment) shows in seconds, which
        vary little from step to step, so it is told apart from plain within MIN_STEPS steps where the committed
        tokens of sampled steps would need a hundred."""
        a, p = self.arms[k], self.arms[0]
        if a.drafts and a.most / a.seconds < p.rate * (1 - MARGIN):
            return True
        return a.n >= MIN_STEPS and a.expected / a.seconds < p.rate * (1 - MARGIN)

    def loss(self, tokens: float, seconds: float) -> float:
        """What steps that committed `tokens` in `seconds` lost against plain decoding, in plain steps."""
        p = self.arms.get(0)
        if p is None or not p.steps or p.rate <= 0:
            return 0.0
        return max(0.0, seconds - tokens / p.rate) / (p.seconds / p.steps)

    def tried(self, loss: float, budget: float = 1.0) -> None:
        """A try (a re-try or an exploration) lost `loss` plain steps: no other try of the class starts before
        it is paid for within RETRY_BUDGET (`budget` times it) of plain decoding's time, one budget for the
        class however many K it tries."""
        self.next_try = max(self.next_try, self.steps + math.ceil(loss / (RETRY_BUDGET * budget)))

    def lose(self, k: int) -> None:
        """Abandon arm k until a re-try: after the doubling wait, and the class's budget (tried)."""
        a = self.arms[k]
        self.wait[k] = min(MAX_RETRY, 2 * self.wait.get(k, RETRY // 2))
        self.lost[k] = self.steps + self.wait[k]
        self.tried(self.loss(a.tokens, a.seconds) * min(a.n, MIN_STEPS) / a.steps)
        self.retrying.discard(k)
        if self.costs_more(k):
            self.costly.add(k)

    def at_zero(self, alternative) -> int:
        """The model says K = 0; alternative() is its best-priced K > 0 (adaptive.Alternative), asked only when a
        K > 0 arm of the class measures faster than plain or an exploration is due. -> that arm where the model
        priced it near plain (both are within the noise there: the measured mean decides), an exploration, else
        0."""
        if self.explore_at is None:          # a stretch at K = 0 begins
            self.explore_wait = RETRY
            self.explore_at = self.steps + RETRY
        p = self.arms.get(0)
        winning = [j for j, a in self.arms.items() if j and j not in self.lost and a.n >= MIN_STEPS
                   and p is not None and p.n >= MIN_STEPS and a.rate > (1 + MARGIN) * p.rate]
        due = self.steps >= max(self.explore_at, self.next_try)
        if not (winning or due):
            return 0
        alt = alternative()
        if winning and alt.near:
            return max(winning, key=lambda j: self.arms[j].rate)
        if not due:
            return 0
        self.explore_at = self.steps + self.explore_wait       # nothing worth trying: asked again after the wait
        self.exploring, self.near, self.upside = alt.k, alt.near, alt.upside
        return alt.k

    def explored(self, drafted: bool, loss: float) -> None:
        """The exploration is over: one that drafted pays for itself (tried), and the wait doubles unless its K was
        priced near plain or had an upside; one that drafted nothing (no proposal) is made again next step."""
        if not drafted:
            self.explore_at = self.steps
            return
        if not (self.near or self.upside):
            self.explore_wait = min(MAX_RETRY, 2 * self.explore_wait)
        self.tried(loss, UPSIDE if self.upside else 1.0)

    def beats(self, k: int, other: int) -> bool:
        a, b = self.arms.get(k), self.arms.get(other)
        if a is None or b is None or a.n < MIN_STEPS or b.n < MIN_STEPS:
            return False
        return a.rate > b.rate + gap(a, b)


def per_group(key: tuple) -> bool:
    """A class of several (method, band) groups is decided per group, each over the class of a batch of that group
    alone at the same rows bucket (engine/batch_k.py, which counts each group's share of a mixed step there); its
    own rates are kept (rates()) but choose nothing: the mix's arms would lump steps where different groups drafted."""
    return len(key[0]) > 1


def gap(a: Arm, b: Arm) -> float:
    """The noise margin between two arms' rates: Z standard errors of their difference, at least MARGIN of the
    larger rate."""
    se = math.hypot(a.stderr, b.stderr)
    return max(MARGIN * max(a.rate, b.rate), Z * se if math.isfinite(se) else 0.0)


class RateBandit:
    """Measured rates per arm class and the choice of K from them (see the module docstring)."""

    def __init__(self):
        self.classes: dict[tuple, ArmClass] = {}

    def cls(self, key: tuple) -> ArmClass:
        return self.classes.setdefault(key, ArmClass())

    def decide(self, key: tuple, model_k: int, alternative=lambda: NO_ALTERNATIVE) -> int:
        """The step's K given the cost model's choice model_k over a batch of class `key`; alternative(): its
        best-priced K > 0 while it says K = 0 (ArmClass.at_zero). A mixed class: model_k, its groups decide
        (per_group)."""
        if per_group(key):
            return model_k
        c = self.cls(key)
        for k in [k for k, at in c.lost.items() if c.steps >= max(at, c.next_try)]:   # re-try: measured afresh
            del c.lost[k]
            c.costly.discard(k)
            c.arms.pop(k, None)
            c.retrying.add(k)
        if model_k == 0:
            model_k = c.at_zero(alternative)
            if c.exploring or not model_k:
                return model_k
        else:
            c.explore_at = None
        if not c.steps:                 # nothing measured in this class: the prior decides
            return model_k
        p = c.arms.get(0)
        if p is None or p.n < 2:
            return 0
        a = c.arms.get(model_k)
        clear = a is not None and a.n >= MIN_STEPS and a.rate > (1 + CLEAR) * p.rate
        if c.since_plain >= (PLAIN_EVERY_CLEAR if clear else PLAIN_EVERY):
            return 0
        k = model_k
        if k not in c.lost and c.loses(k):
            if c.since_plain > FRESH:
                return 0                # confirm against plain decoding now
            c.lose(k)
        unmeasured = k not in c.retrying and (k not in c.arms or c.arms[k].n < MIN_STEPS)
        if k in c.lost or (c.costly and unmeasured):
            # abandoned (an unmeasured K too, once a K of the class has lost on its seconds: the same costs miss it,
            # and trying each K in turn would pay MIN_STEPS losing steps per K; not on its tokens: a copying
            # proposer's K follows its proposal, and a K whose short matches missed says nothing of a long one's):
            # a measured arm that does not lose takes its place, else plain decoding
            alive = [j for j in c.arms if j and j not in c.lost and not c.loses(j)
                     and c.arms[j].n >= MIN_STEPS]
            return max(alive, key=lambda j: c.arms[j].rate) if alive else 0
        better = [j for j in c.arms if j and j != k and j not in c.lost and c.beats(j, k)]
        return max(better, key=lambda j: c.arms[j].rate) if better else k

    def observe(self, key: tuple, k: int, tokens: int, seconds: float, most: int | None = None,
                level: float = 1.0, expected: float | None = None, drafted: int | None = None) -> None:
        """A step of class `key` at K = k committed `tokens` (at most `most`, had every draft been accepted; the
        cost model expected `expected`, None: as many as committed) in `seconds` of wall time, while a one-token
        forward cost `level` seconds; `drafted` of its tokens were drafted (None: unknown)."""
        if seconds <= 0 or tokens <= 0:
            return
        c = self.cls(key)
        c.steps += 1
        explored, c.exploring = k == c.exploring and k > 0, 0
        c.arm(k).decay(PLAIN_DECAY if k == 0 else DECAY)
        c.level = level
        most = tokens if most is None else max(tokens, most)
        c.arm(k).add(tokens, most, seconds / level, tokens if expected is None else expected,
                     most - tokens if drafted is None else drafted)
        c.since_plain = 0 if k == 0 else c.since_plain + 1
        if explored:                    # charged at what its arm loses a step, as measured
            a = c.arms[k]
            c.explored(drafted != 0, c.loss(a.tokens, a.seconds) / a.steps)
        if k == 0:
            return
        if k not in c.lost and c.since_plain <= FRESH and c.loses(k):
            c.lose(k)
        elif k in c.retrying and c.arms[k].n >= MIN_STEPS:
            c.retrying.discard(k)               # taken back
            c.wait.pop(k, None)

    def off(self, key: tuple) -> bool:
        """Every drafting arm measured in this class loses to plain decoding (the K = 0 evidence is not worth its
        cost there: re-tries measure drafting directly)."""
        c = self.classes.get(key)
        return c is not None and bool(c.lost) and not any(
            k and k not in c.lost and a.n >= MIN_STEPS for k, a in c.arms.items())

    def pays(self, key: tuple) -> bool:
        """Some drafting arm of the class is measured (MIN_STEPS steps, not on a re-try, not abandoned) above
        plain decoding's rate."""
        c = self.classes.get(key)
        p = c.arms.get(0) if c is not None else None
        return p is not None and p.n > 0 and any(k and k not in c.lost and k not in c.retrying and a.n >= MIN_STEPS
                                                 and a.rate > p.rate for k, a in c.arms.items())

    def gain(self, key: tuple) -> float:
        """The class's best measured drafting rate over plain decoding's (0.0: either is not measured)."""
        c = self.classes.get(key)
        p = c.arms.get(0) if c is not None else None
        best = max((a.rate for k, a in c.arms.items() if k and a.n), default=0.0) if c is not None else 0.0
        return best / p.rate if p is not None and p.n and p.rate > 0 else 0.0

    def rates(self) -> dict[tuple, dict[int, float]]:
        """The read API: class key -> {K: committed tokens per wall-second at the present load} (arms with a
        measurement). A class key is (((method, band), ...), rows bucket): priors.acceptance_band's bands."""
        return {key: {k: a.rate / c.level for k, a in sorted(c.arms.items()) if a.n > 0}
                for key, c in self.classes.items() if any(a.n for a in c.arms.values())}

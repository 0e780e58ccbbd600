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
     measurements or none for PLAIN_EVERY steps of the class (PLAIN_EVERY_CLEAR when drafting wins clearly)
  2. abandons an arm measured below plain beyond the noise margin (the standard errors of both rates, at least
     MARGIN): an arm the model overrates runs at most MIN_STEPS steps once plain is measured, one step when even
     accepting all its drafts would not reach plain's rate; then K = 0 (other unmeasured K of the class too)
  3. re-tries an abandoned arm after RETRY steps of its class, its old measurements forgotten, the wait doubling
     after each loss up to MAX_RETRY and at least what keeps re-tries within RETRY_BUDGET of plain decoding's
     time; an arm that now pays is taken back and the wait reset
  4. picks, among measured K > 0 arms, one that beats the model's K beyond the margin
A mixed class (rows of several methods or bands) is not decided here but per group (per_group).

It only chooses K: what is accepted is the verifier's.
`rates()` is the read API: the current rate per arm class and arm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

DECAY = 0.9              # per step of a drafting arm: its last 10 or so steps make its rate
PLAIN_DECAY = 0.4        # per plain step: the latest one weighs 60%, so a loss is judged against the present load
FRESH = 2                # a loss is judged only against a plain step at most this many steps of the class old
MIN_STEPS = 3            # measurements before an arm is judged by its mean
PRIOR_STEPS = 2          # the weight, in steps, of the prior on a drafting arm's spread (Arm.stderr)
MARGIN = 0.03            # the least relative gap that counts as a loss (noise a deterministic clock cannot show)
Z = 2.0                  # standard errors of the gap that count as noise
PLAIN_EVERY = 16         # steps of a drafting class between plain steps, near break-even
PLAIN_EVERY_CLEAR = 64   # ... while drafting beats plain by more than CLEAR
CLEAR = 0.25
RETRY = 16               # steps of a class before an abandoned arm is tried again (doubles after each loss)
MAX_RETRY = 256
RETRY_BUDGET = 0.01      # re-tries cost at most this share of plain decoding's time


@dataclass
class Arm:
    """Discounted sums of the steps that ran one K in one class (seconds in one-token forwards at the load of the
    moment)."""
    n: int = 0               # steps measured (not discounted: when the arm may be judged)
    steps: float = 0.0       # effective number of steps
    tokens: float = 0.0
    most: float = 0.0        # the tokens its steps could have committed had every draft been accepted
    seconds: float = 0.0
    r1: float = 0.0          # sum of per-step rates (tokens / seconds)
    r2: float = 0.0          # ... of their squares (the noise margin)

    def decay(self, f: float) -> None:
        self.steps *= f
        self.tokens *= f
        self.most *= f
        self.seconds *= f
        self.r1 *= f
        self.r2 *= f

    def add(self, tokens: float, most: float, seconds: float) -> None:
        r = tokens / seconds
        self.n += 1
        self.steps += 1.0
        self.tokens += tokens
        self.most += most
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

    def arm(self, k: int) -> Arm:
        return self.arms.setdefault(k, Arm())

    def loses(self, k: int) -> bool:
        """Arm k measured below plain beyond the noise; at once when even accepting every draft at its measured
        seconds would not reach plain's rate (a draft slower than the target loses at its first step). Not on
        one step's tokens: a sampled step that drafts well on average often yields one token."""
        a, p = self.arms.get(k), self.arms.get(0)
        if a is None or p is None or a.n < 1 or p.n < 1:
            return False
        if a.most / a.seconds < p.rate * (1 - MARGIN):
            return True
        return a.n >= MIN_STEPS and a.rate < p.rate - gap(a, p)

    def lose(self, k: int) -> None:
        """Abandon arm k until a re-try: after the doubling wait, and at least what keeps a re-try's step, at the
        loss per step measured, within RETRY_BUDGET of plain decoding's time."""
        a, p = self.arms[k], self.arms[0]
        plain_step = p.seconds / p.steps
        loss = max(0.0, (a.seconds - a.tokens / p.rate) / a.steps) / plain_step      # plain steps per step
        self.wait[k] = min(MAX_RETRY, 2 * self.wait.get(k, RETRY // 2))
        self.lost[k] = self.steps + max(self.wait[k], math.ceil(loss / RETRY_BUDGET))
        self.retrying.discard(k)

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

    def decide(self, key: tuple, model_k: int) -> int:
        """The step's K given the cost model's choice model_k over a batch of class `key` (a mixed class: model_k,
        its groups decide: per_group)."""
        if per_group(key):
            return model_k
        c = self.cls(key)
        for k in [k for k, at in c.lost.items() if c.steps >= at]:     # re-try: measured afresh
            del c.lost[k]
            c.arms.pop(k, None)
            c.retrying.add(k)
        if model_k == 0:
            return 0
        if not c.steps:                 # nothing measured in this class: the prior decides
            return model_k
        p = c.arms.get(0)
        if p is None or p.n < 2:
            return 0
        drafting = [a for j, a in c.arms.items() if j and a.n >= MIN_STEPS]
        clear = bool(drafting) and all(a.rate > (1 + CLEAR) * p.rate for a in drafting)
        if c.since_plain >= (PLAIN_EVERY_CLEAR if clear else PLAIN_EVERY):
            return 0
        k = model_k
        if k not in c.lost and c.loses(k):
            if c.since_plain > FRESH:
                return 0                # confirm against plain decoding now
            c.lose(k)
        unmeasured = k not in c.retrying and (k not in c.arms or c.arms[k].n < MIN_STEPS)
        if k in c.lost or (c.lost and unmeasured):
            # abandoned (an unmeasured K too, once a K of the class has lost: the same costs miss it, and trying each
            # K in turn would pay MIN_STEPS losing steps per K): a measured arm that does not lose takes its place,
            # else plain decoding
            alive = [j for j in c.arms if j and j not in c.lost and not c.loses(j)
                     and c.arms[j].n >= MIN_STEPS]
            return max(alive, key=lambda j: c.arms[j].rate) if alive else 0
        better = [j for j in c.arms if j and j != k and j not in c.lost and c.beats(j, k)]
        return max(better, key=lambda j: c.arms[j].rate) if better else k

    def observe(self, key: tuple, k: int, tokens: int, seconds: float, most: int | None = None,
                level: float = 1.0) -> None:
        """A step of class `key` at K = k committed `tokens` (at most `most`, had every draft been accepted) in
        `seconds` of wall time, while a one-token forward cost `level` seconds."""
        if seconds <= 0 or tokens <= 0:
            return
        c = self.cls(key)
        c.steps += 1
        c.arm(k).decay(PLAIN_DECAY if k == 0 else DECAY)
        c.level = level
        c.arm(k).add(tokens, tokens if most is None else max(tokens, most), seconds / level)
        c.since_plain = 0 if k == 0 else c.since_plain + 1
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

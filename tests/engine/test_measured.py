"""Measured rates (engine/kpolicy/measured.py) overruling the cost model's K, through the policy as the batch step sees
it (engine/kpolicy/policy.py): scripted proposers, an injected clock (each step's wall seconds are a function of
what it drafted, not the machine's), no model. Deterministic."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from leaplm.engine.kpolicy import measured
from leaplm.engine.kpolicy.acceptance import AcceptanceEstimate
from leaplm.engine.kpolicy.adaptive import Alternative
from leaplm.engine.kpolicy.estimates import Estimates
from leaplm.engine.kpolicy.measured import MIN_STEPS, RateBandit
from leaplm.engine.kpolicy.policy import KPolicy, RowStep
from leaplm.engine.row import Row

PLAIN = 7e-3      # a one-token forward


def block(T: int) -> float:
    """A forward over T tokens as SmolLM2 Q4_1 measured at 2 threads: 1.5x a one-token forward and more."""
    return PLAIN * (1.0 if T == 1 else 1.5 + 0.125 * (T - 1))


def estimates(propose_s: float = 4.6e-4) -> Estimates:
    est = Estimates()
    est.costs.calibrated(1, [{T: block(T) for T in range(1, 10)}])
    est.observe_propose("draft", propose_s, rows=1)
    return est


def draft_row(prior: float | None = 0.8, cap: int = 4) -> Row:
    """A draft-model row whose estimate has seen `prior` per token (None: a new request's prior)."""
    proposer = SimpleNamespace(cheap=False, bursty=False, group=object(), reads_hidden=False, shadows=False,
                               lag=lambda n: 0)
    req = SimpleNamespace(tokens=list(range(200)), remaining=10_000, grammar=None,
                          stats=SimpleNamespace(target_forwards=1, method="draft"))
    est = AcceptanceEstimate(bursty=False)
    if prior is not None:
        rng = random.Random(0)
        for _ in range(40):
            est.observe(cap, sum(1 for _ in range(cap) if rng.random() < prior), cap)
    return Row(req, None, proposer, cap, acceptance=est)


def run(policy: KPolicy, row: Row, steps: int, accept, clock, tokens: int | None = None,
        propose_s: float | None = None, load=lambda s: 1.0, commit=lambda s, k: 0.0
        ) -> tuple[list[int], float, int]:
    """Steps over one row: step s accepts accept(s, k) of its k drafts and takes clock(s, k) wall seconds (the
    injected clock), told to the policy as the batch step tells it; its proposer's seconds per token are
    propose_s (None: all of the step's time beyond its forward), its forward block(k + 1), both times the
    machine's load(s); commit(s, k) of its seconds are its commit's (not in the seconds the cost model compares
    with its prediction, as engine/stats.StepClock.policy_seconds leaves them out). Stops after `tokens` tokens
    when given.
    -> (K of each step, seconds, tokens)."""
    ks, seconds, total = [], 0.0, 0
    for s in range(steps):
        plan = policy.plan([row], lambda i, cap: None, 64)
        k = plan.k
        acc = min(k, accept(s, k))
        wall = clock(s, k)
        policy.observe_forward(1, k + 1, load(s) * block(k + 1))
        if k:
            policy.observe_propose("draft", (wall - load(s) * block(k + 1)) / k if propose_s is None
                                   else load(s) * propose_s, rows=1)
        policy.observe([row], plan, [RowStep(k, acc, k + 1)], wall=wall)
        ks.append(k)
        seconds += wall
        total += 1 + acc
        if tokens is not None and total >= tokens:
            break
    return ks, seconds, total


def test_an_arm_the_cost_model_overrates_is_abandoned_within_min_steps():
    """The cost model prices K = 4 at 0.46 ms a draft token and acceptance 0.8 (a gain); the clock charges each
    drafting step 24 ms more in its commit (a draft model's state brought back to the accepted tokens: outside
    the cost model and the seconds it checks its predictions with), so K = 4 yields about 4.2 tokens in 40 ms
    where plain yields 1 in 7 ms. Once plain is measured (two plain steps), drafting runs at most MIN_STEPS
    steps, then the row decodes plainly until a re-try."""
    rng = random.Random(1)
    accept = lambda s, k: sum(1 for _ in range(k) if rng.random() < 0.8)
    commit = lambda s, k: 24 * PLAIN / 7 if k else 0.0
    clock = lambda s, k: (PLAIN if k == 0 else block(k + 1) + k * 4.6e-4) + commit(s, k)
    policy = KPolicy(estimates(), enabled=True, max_len=4096)
    ks, _, _ = run(policy, draft_row(), 60, accept, clock, propose_s=4.6e-4, commit=commit)
    first_plain = ks.index(0)
    assert ks[first_plain:first_plain + 2] == [0] * 2, ks
    assert sum(1 for k in ks[first_plain:] if k) <= MIN_STEPS, ks
    # negative control: without the measured rates the model drafts throughout
    off = KPolicy(estimates(), enabled=True, max_len=4096)
    off.estimates.rates.decide = lambda key, k, explore=None: k
    ks_off, _, _ = run(off, draft_row(), 60, accept, clock, propose_s=4.6e-4, commit=commit)
    assert sum(1 for k in ks_off if k) > 50, ks_off


def test_an_arm_that_starts_badly_and_then_pays_is_taken_back():
    """Drafting costs 2.5x its price for the first 30 steps (a draft catching up on what it skipped), then what the
    model says (K = 4 accepting 0.8: about 2x plain): it is abandoned at once, re-tried after the wait that keeps
    a re-try within measured.RETRY_BUDGET of plain decoding (2.2 plain steps lost a step: 220 steps), and taken
    back: it drafts throughout the last 150 steps but for the plain steps that keep plain measured."""
    rng = random.Random(2)
    accept = lambda s, k: sum(1 for _ in range(k) if rng.random() < 0.8)
    clock = lambda s, k: PLAIN if k == 0 else (block(k + 1) + k * 4.6e-4) * (2.5 if s < 30 else 1.0)
    policy = KPolicy(estimates(), enabled=True, max_len=4096)
    ks, _, _ = run(policy, draft_row(), 450, accept, clock)
    assert ks[:30].count(0) > 25, ks[:30]                               # abandoned while it lost
    late = ks[-150:]
    assert sum(1 for k in late if k) > 0.9 * len(late), late            # taken back
    key = next(iter(policy.measured_rates()))
    rates = policy.measured_rates()[key]
    assert rates[4] > 1.2 * rates[0], rates


@pytest.mark.parametrize("case", ["always wrong", "draft slower than the target"])
def test_a_proposer_that_never_pays_reaches_plain_decodings_rate_within_2_percent(case):
    """256 tokens with a new request's prior estimate: a proposer whose every draft is wrong (priced right), or a
    draft whose token costs 1.5 target forwards where the model's price says 0.46 ms; the injected clock's
    seconds against 256 plain steps'."""
    if case == "always wrong":
        accept = lambda s, k: 0
        clock = lambda s, k: PLAIN if k == 0 else block(k + 1) + k * 4.6e-4
    else:
        rng = random.Random(3)
        accept = lambda s, k: sum(1 for _ in range(k) if rng.random() < 0.7)
        clock = lambda s, k: PLAIN if k == 0 else block(k + 1) + k * 1.5 * PLAIN
    policy = KPolicy(estimates(), enabled=True, max_len=4096)
    ks, seconds, tokens = run(policy, draft_row(prior=None), 1000, accept, clock, tokens=256)
    rate, plain = tokens / seconds, 1 / PLAIN
    assert rate >= 0.98 * plain, (rate / plain, ks)


def test_a_busy_machine_does_not_switch_speculation_off():
    """Drafting pays (K = 4 at about 2x plain); from step 40 to 120 another process makes every step 3x slower,
    plain ones as well: steps are counted in one-token forwards at the load of the moment, and the row keeps
    drafting through the burst and after it."""
    rng = random.Random(4)
    accept = lambda s, k: sum(1 for _ in range(k) if rng.random() < 0.8)

    load = lambda s: 3.0 if 40 <= s < 120 else 1.0
    clock = lambda s, k: load(s) * (PLAIN if k == 0 else block(k + 1) + k * 4.6e-4)
    policy = KPolicy(estimates(), enabled=True, max_len=4096)
    ks, _, _ = run(policy, draft_row(), 200, accept, clock, propose_s=4.6e-4, load=load)
    busy = ks[40:]                                  # the burst and after it, when old slow steps weigh on drafting
    assert sum(1 for k in busy if k) > 0.9 * len(busy), busy
    assert not policy.estimates.rates.classes[next(iter(policy.measured_rates()))].lost


def test_rates_are_kept_apart_per_arm_class_and_each_arm_discounted_by_its_own_steps():
    """Two classes (greedy, sampled) of the same method keep their own rates; a plain step discounts only plain's
    measurements (by PLAIN_DECAY: the latest plain step weighs most), a drafting step only its arm's."""
    b = RateBandit()
    g, t = ((("draft", "greedy"),), 1), ((("draft", "sampled"),), 1)
    for _ in range(4):
        b.observe(g, 0, 1, 0.01)
        b.observe(g, 4, 3, 0.02)
        b.observe(t, 4, 1, 0.02)
    assert b.rates()[g] == pytest.approx({0: 100.0, 4: 150.0})
    assert b.rates()[t] == pytest.approx({4: 50.0})
    drafting, plain = b.classes[g].arms[4].steps, b.classes[g].arms[0].steps
    assert drafting == pytest.approx(sum(measured.DECAY ** j for j in range(4)))
    b.observe(g, 0, 1, 0.03)
    assert b.classes[g].arms[4].steps == drafting
    assert b.classes[g].arms[0].steps == pytest.approx(plain * measured.PLAIN_DECAY + 1)
    assert b.rates()[g][0] == pytest.approx((plain * measured.PLAIN_DECAY + 1) /
                                            (plain * measured.PLAIN_DECAY * 0.01 + 0.03))
    assert b.classes[t].arms[4].n == 4


def test_the_evidence_at_k0_stops_while_every_drafting_arm_measured_loses():
    """A row at K = 0 keeps scoring its proposer (shadow.py) only while drafting is not measured to lose: in the
    overrated case above, once K = 4 is abandoned the evidence is not gathered until a re-try takes it back."""
    rng = random.Random(5)
    accept = lambda s, k: sum(1 for _ in range(k) if rng.random() < 0.8)
    commit = lambda s, k: 24 * PLAIN / 7 if k else 0.0
    clock = lambda s, k: (PLAIN if k == 0 else block(k + 1) + k * 4.6e-4) + commit(s, k)
    policy = KPolicy(estimates(), enabled=True, max_len=4096)
    scored = []
    policy._shadow = lambda r, d, plan, i: scored.append(plan.k)
    ks, _, _ = run(policy, draft_row(), 60, accept, clock, propose_s=4.6e-4, commit=commit)
    key = next(iter(policy.measured_rates()))
    assert policy.estimates.rates.off(key)
    lost_at = max(i for i, k in enumerate(ks) if k) + 1
    assert len(scored) <= lost_at + measured.FRESH < 60, (len(scored), ks)   # plain steps confirm the loss
    # negative control: with the gate open, every step gathers evidence
    rng.seed(5)
    policy = KPolicy(estimates(), enabled=True, max_len=4096)
    policy.estimates.rates.off = lambda key: False
    scored = []
    policy._shadow = lambda r, d, plan, i: scored.append(plan.k)
    run(policy, draft_row(), 60, accept, clock, propose_s=4.6e-4, commit=commit)
    assert len(scored) == 60


def test_steps_of_a_grammars_forced_tokens_are_not_counted():
    """A step whose drafts were all forced tokens (timed False) is no choice of K: no arm's rate moves."""
    policy = KPolicy(estimates(), enabled=True, max_len=4096)
    row = draft_row()
    plan = policy.plan([row], lambda i, cap: None, 64)
    policy.observe([row], plan, [RowStep(6, 6, 7)], timed=False, wall=PLAIN)
    assert policy.measured_rates() == {}
    policy.observe([row], plan, [RowStep(0, 0, 1)], timed=True, wall=PLAIN)
    assert list(policy.measured_rates().values()) == [{plan.k: pytest.approx(1 / PLAIN)}]


def test_sampled_drafting_that_pays_by_a_thin_margin_is_kept():
    """T = 0.8-like acceptance (each draft token 0.45, so a step yields one token more often than not) where
    drafting pays about 1.1x on average and the cost model prices it right: one-token steps are noise, not a
    loss; the row drafts most steps and keeps at least 95% of what the cost model alone reaches (the price of
    keeping plain decoding measured near break-even)."""
    def go(measured_rates: bool) -> tuple[list[int], float]:
        rng = random.Random(6)

        def accept(s, k):
            n = 0
            while n < k and rng.random() < 0.45:
                n += 1
            return n

        clock = lambda s, k: PLAIN if k == 0 else PLAIN * 1.3 + k * 4.6e-4
        policy = KPolicy(estimates(), enabled=True, max_len=4096)
        policy.estimates.costs.calibrated(1, [{T: PLAIN if T == 1 else PLAIN * 1.3 for T in range(1, 10)}])
        if not measured_rates:
            policy.estimates.rates.decide = lambda key, k, explore=None: k
        ks, seconds, tokens = run(policy, draft_row(prior=0.45), 400, accept, clock, propose_s=4.6e-4)
        return ks, tokens / seconds

    ks, rate = go(True)
    _, model_only = go(False)
    assert sum(1 for k in ks if k) > 0.7 * len(ks), ks
    assert rate >= 0.95 * model_only, (rate / model_only, ks)
    assert rate > 1.05 / PLAIN


def test_an_engine_measures_its_plain_steps_and_keeps_greedy_output(loaded):
    """Through the batch step on a tiny model: a draft row's steps are measured in its class (its first step is
    plain, so plain decoding has a rate), and the output equals plain decoding's token for token (the measured
    rates choose K only)."""
    from leaplm.config import SamplingParams
    from leaplm.engine.engine import Engine
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    plain = Engine(loaded("llama_tied"), method="none").generate([1, 5, 9, 3, 7], params)
    eng = Engine(loaded("llama_tied"), draft=loaded("llama_draft"), method="draft", k=4)
    for _ in range(2):
        out = eng.generate([1, 5, 9, 3, 7], params)
        assert out.token_ids == plain.token_ids
    rates = eng.estimates.rates.rates()
    key = ((("draft", "greedy"),), 1)
    assert key in rates and rates[key][0] > 0, rates


@pytest.mark.parametrize("near", [False, True])
def test_explorations_at_k0_double_their_wait_unless_priced_near_plain(near):
    """The model says K = 0 throughout; its best-priced K > 0 is 3. The bandit tries it RETRY steps into the
    stretch, then after the current wait, which doubles after each try (from RETRY, up to MAX_RETRY), or, priced
    within adaptive.NEAR of plain, stays RETRY; a try in which no row had a proposal (drafted 0) taught nothing
    and is made again at the next step. The tries lose nothing here (priced at plain's rate), so the budget does
    not lengthen the waits."""
    b, key = RateBandit(), ((("draft", "greedy"),), 1)
    alt = Alternative(3, near)
    tries, empty = [], True
    for s in range(1200):
        k = b.decide(key, 0, lambda: alt)
        drafted = 0 if (k and empty) else k
        if k:
            tries.append(s)
            empty = not empty                      # every other try has no proposal
        b.observe(key, k, 1 + drafted, 1.0 + drafted, most=1 + drafted, drafted=drafted)
    made = [s for i, s in enumerate(tries) if i % 2 == 1]          # the tries that drafted
    assert all(b - a == 1 for a, b in zip(tries[::2], tries[1::2])), tries   # an empty try: again next step
    gaps = [b - a for a, b in zip(made, made[1:])]
    if near:
        assert set(gaps) == {measured.RETRY + 1}, gaps
    else:
        assert gaps[:4] == [measured.RETRY + 1, 2 * measured.RETRY + 1, 4 * measured.RETRY + 1,
                            8 * measured.RETRY + 1] and max(gaps) == measured.MAX_RETRY + 1, gaps

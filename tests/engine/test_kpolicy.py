"""The K policy as the batch step sees it (engine/kpolicy/policy.py) on fake rows and a fixed cost model: what a step at
K = 0 costs the policy, and that holding K = 0 never changes a choice. Deterministic, no model, no timing."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from leaplm.engine.kpolicy import adaptive
from leaplm.engine.kpolicy import policy as kpolicy
from leaplm.engine.kpolicy.acceptance import AcceptanceEstimate
from leaplm.engine.kpolicy.estimates import Estimates
from leaplm.engine.kpolicy.policy import KPolicy, RowStep
from leaplm.engine.row import Row


def smollm2_like() -> Estimates:
    """Costs as SmolLM2 Q4_1 measured on the int8 kernel at 2 threads: a one-token forward 7 ms, a block of 5
    tokens 2.00x, a drafted token 0.46 ms, the draft's prefill 0.1 ms a token."""
    est = Estimates()
    est.costs.calibrated(1, [{T: 7e-3 * (1.0 if T == 1 else 1.5 + 0.125 * (T - 1)) for T in range(1, 10)}])
    est.observe_propose("draft", 4.6e-4, rows=1)
    est.draft_prefill_s_per_token = 1e-4
    return est


def draft_row(acceptance: float, lag: int = 0, remaining: int = 500) -> Row:
    """A draft-model row (not cheap, one acceptance state) whose estimate has seen `acceptance` per token."""
    proposer = SimpleNamespace(cheap=False, bursty=False, group=object(), reads_hidden=False, shadows=False,
                               lag=lambda n: lag)
    req = SimpleNamespace(tokens=list(range(200)), remaining=remaining, grammar=None,
                          stats=SimpleNamespace(target_forwards=1, method="draft"))
    est = AcceptanceEstimate(bursty=False)
    rng = random.Random(0)
    for _ in range(40):
        est.observe(4, sum(1 for _ in range(4) if rng.random() < acceptance), 4)
    return Row(req, None, proposer, 4, acceptance=est)


def run(policy: KPolicy, row: Row, steps: int, rng: random.Random, evidence_at: int | None = None) -> list[int]:
    """Steps over one row: each drafting step accepts by the row's own rate; at step evidence_at the row's
    estimate is told that its proposals are now accepted whole (as when a request turns to copying)."""
    ks = []
    for s in range(steps):
        if s == evidence_at:
            for _ in range(30):
                row.acceptance.observe(4, 4, 4)
        plan = policy.plan([row], lambda i, cap: None, 64)
        k = plan.k
        policy.proposed([object() if k else None])          # the draft always has a proposal
        acc = 0
        while acc < k and rng.random() < 0.2:
            acc += 1
        policy.observe([row], plan, [RowStep(k, acc, k + 1)], 7e-3 * (1.0 if k == 0 else 1.5 + 0.125 * k), 0.0)
        ks.append(k)
    return ks


def test_a_step_at_k0_is_not_priced_again_until_a_probe_is_due(monkeypatch):
    """At K = 0 over a row whose acceptance cannot change (a draft model learns nothing while it does not draft),
    every K would be priced again at every step, for the same answer: held, the step is priced only when a probe
    is due (and at least every HOLD_STEPS steps)."""
    calls = []
    best = adaptive.BatchAdaptiveK.best
    monkeypatch.setattr(adaptive.BatchAdaptiveK, "best", lambda self, rows: calls.append(1) or best(self, rows))
    policy = KPolicy(smollm2_like(), enabled=True, max_len=4096)
    ks = run(policy, draft_row(0.15), 400, random.Random(1))
    plain = ks.count(0)
    assert plain > 350, ks                            # priced out: K = 0 nearly throughout
    assert len(calls) <= 400 / kpolicy.HOLD_STEPS * 3 + 3 * (400 - plain), len(calls)


@pytest.mark.parametrize("acceptance,evidence_at", [(0.15, None), (0.15, 120), (0.45, None), (0.45, 60)])
def test_holding_k0_chooses_what_pricing_every_step_chooses(monkeypatch, acceptance, evidence_at):
    """The same requests, the same outcomes (seeded), with and without the hold: the same K at every step, new
    evidence on the row included (the hold is released by it)."""
    held = run(KPolicy(smollm2_like(), True, 4096), draft_row(acceptance), 300, random.Random(2), evidence_at)
    monkeypatch.setattr(kpolicy, "HOLD_STEPS", 0)
    priced = run(KPolicy(smollm2_like(), True, 4096), draft_row(acceptance), 300, random.Random(2), evidence_at)
    assert held == priced
    if evidence_at is not None:
        assert all(k > 0 for k in held[evidence_at + 1: evidence_at + 20])      # the evidence was acted on


@pytest.mark.parametrize("lag,remaining,probes", [(300, 120, False), (0, 120, True), (300, 2000, True)])
def test_a_probe_is_made_only_while_the_drafts_catching_up_fits_the_probe_budget(lag, remaining, probes):
    """A draft model that has not drafted yet must first prefill the whole prompt (300 tokens at 0.1 ms: 4.3
    plain steps at once, whatever the probe finds): a probe is made only while that is within the probe budget (2%)
    of the plain steps the request has left, so a short request where the draft does not pay runs as plain
    decoding. Controls: without the catching up (lag 0), or with 2000 tokens left, the same row probes."""
    ks = run(KPolicy(smollm2_like(), True, 4096), draft_row(0.2, lag, remaining), 120, random.Random(3))
    assert any(k > 0 for k in ks) == probes, ks

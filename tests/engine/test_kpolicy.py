"""How K is chosen end to end (engine/kpolicy/policy.py) on fake rows, a fixed cost model and an injected clock: a
row the cost model keeps at K = 0 is tried again by the measured rates within a bounded number of steps, within
their budget. Deterministic, no model, no timing."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from leaplm.engine.kpolicy import measured
from leaplm.engine.kpolicy.acceptance import AcceptanceEstimate
from leaplm.engine.kpolicy.estimates import Estimates
from leaplm.engine.kpolicy.policy import KPolicy, RowStep
from leaplm.engine.row import Row

PLAIN = 7e-3


def block(k: int) -> float:
    """SmolLM2 Q4_1 on the int8 kernel at 2 threads: a block of k + 1 tokens, a drafted token 0.46 ms each."""
    return PLAIN * (1.0 if k == 0 else 1.5 + 0.125 * k) + k * 4.6e-4


def smollm2_like() -> Estimates:
    """Those costs, and the draft's prefill 0.1 ms a token."""
    est = Estimates()
    est.costs.calibrated(1, [{T: block(0) * (1.0 if T == 1 else 1.5 + 0.125 * (T - 1)) for T in range(1, 10)}])
    est.observe_propose("draft", 4.6e-4, rows=1)
    est.draft_prefill_s_per_token = 1e-4
    return est


def draft_row(acceptance: float, lag: int = 0, remaining: int = 10_000) -> Row:
    """A draft-model row (not cheap, one acceptance state, no evidence at K = 0) whose estimate has seen
    `acceptance` per token."""
    proposer = SimpleNamespace(cheap=False, bursty=False, group=object(), reads_hidden=False, shadows=False,
                               lag=lambda n: lag)
    req = SimpleNamespace(tokens=list(range(200)), remaining=remaining, grammar=None,
                          stats=SimpleNamespace(target_forwards=1, method="draft"))
    est = AcceptanceEstimate(bursty=False)
    rng = random.Random(0)
    for _ in range(40):
        est.observe(4, sum(1 for _ in range(4) if rng.random() < acceptance), 4)
    return Row(req, None, proposer, 4, acceptance=est)


def run(policy: KPolicy, row: Row, steps: int, accept) -> tuple[list[int], float, int]:
    """Steps over one row: a drafting step at K accepts accept(s, K) and takes block(K) on the injected clock.
    -> (K of each step, seconds, tokens)."""
    ks, seconds, tokens = [], 0.0, 0
    for s in range(steps):
        plan = policy.plan([row], lambda i, cap: None, 64)
        k = plan.k
        acc = min(k, accept(s, k))
        policy.observe_forward(1, k + 1, block(k) - k * 4.6e-4)
        policy.observe([row], plan, [RowStep(k, acc, k + 1)], wall=block(k))
        ks.append(k)
        seconds += block(k)
        tokens += 1 + acc
    return ks, seconds, tokens


def test_a_row_priced_out_is_tried_again_within_a_bounded_number_of_steps():
    """A draft whose estimate says 0.15 per token (priced out: K = 0) and that never learns at K = 0: the measured
    rates try K > 0 RETRY steps into the stretch, then after waits that double up to MAX_RETRY, and at least what
    keeps the tries within RETRY_BUDGET of plain decoding's time; they cost at most that budget."""
    policy = KPolicy(smollm2_like(), enabled=True, max_len=4096)
    ks, seconds, tokens = run(policy, draft_row(0.15), 2000, lambda s, k: 0)
    tries = [i for i, k in enumerate(ks) if k]
    assert tries and tries[0] <= measured.RETRY + 1, tries
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    loss = block(max(ks)) / PLAIN - 1                       # plain steps a try loses (it yields one token)
    bound = max(measured.MAX_RETRY, loss / measured.RETRY_BUDGET) + 1
    assert len(tries) >= 4 and max(gaps) <= bound, (tries, bound)
    assert seconds <= (1 + measured.RETRY_BUDGET + 0.005) * tokens * PLAIN


@pytest.mark.parametrize("lag,remaining,tried", [(300, 120, False), (0, 120, True), (300, 2000, True)])
def test_a_try_is_made_only_while_the_drafts_catching_up_fits_its_budget(lag, remaining, tried):
    """A draft model that has not drafted yet must first prefill the whole prompt (300 tokens at 0.1 ms: 4.3
    plain steps at once, whatever the try finds): it is tried only while that is within CATCHUP_BUDGET (2%) of
    the plain steps the request has left, so a short request where the draft does not pay runs as plain
    decoding. Controls: without the catching up (lag 0), or with 2000 tokens left, the same row is tried."""
    policy = KPolicy(smollm2_like(), enabled=True, max_len=4096)
    ks, _, _ = run(policy, draft_row(0.15, lag, remaining), 120, lambda s, k: 0)
    assert any(k > 0 for k in ks) == tried, ks

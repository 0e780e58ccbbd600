"""Which rows of a batch draft (engine/batch_k.py over the K policy): scripted proposers and an injected clock (each
step's wall seconds a function of what it drafted, not the machine's). Over fake rows through the policy as the
batch step drives it, and through the batch step itself on a tiny model, where the clock is the only thing faked
and the output must equal plain decoding's token for token. Deterministic."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from leaplm.config import SamplingParams
from leaplm.engine.batch_k import BatchK, group_class
from leaplm.engine.kpolicy.acceptance import AcceptanceEstimate
from leaplm.engine.kpolicy.estimates import Estimates
from leaplm.engine.kpolicy.measured import MIN_STEPS
from leaplm.engine.kpolicy.policy import KPolicy, RowStep
from leaplm.engine.row import Row
from leaplm.propose.base import Proposal, ProposerBase, SimpleFactory

PLAIN = 1.0       # a one-token forward over the batch (in the injected clock's units)
PROPOSE_S = 1e-3 * PLAIN  # the cost model's price of a drafted token


def estimates(n: int) -> Estimates:
    """The cost model's view: a block of T tokens over n rows costs 2% a token more than one (a forward that is
    memory-bound, padding included); a drafted token 0.5% of a forward."""
    est = Estimates()
    est.costs.calibrated(n, [{T: PLAIN * (1 + 0.02 * (T - 1)) for T in range(1, 10)}])
    for method in ("good", "bad", "dear"):
        est.observe_propose(method, PROPOSE_S)
    return est


def fake_row(method: str, cap: int = 4) -> Row:
    proposer = SimpleNamespace(cheap=False, bursty=False, group=None, reads_hidden=False, shadows=False,
                               lag=lambda n: 0)
    req = SimpleNamespace(tokens=list(range(50)), remaining=10_000, grammar=None,
                          stats=SimpleNamespace(target_forwards=1, method=method))
    return Row(req, None, proposer, cap, acceptance=AcceptanceEstimate(bursty=False))


def run(rows: list[Row], steps: int, accept, per_token: float, batch_k: bool = True,
        est: Estimates | None = None) -> list[list[int]]:
    """steps over rows, told to the policy and to BatchK as engine/step.py tells them: row i accepts accept(row, k)
    of its k drafts; the injected clock charges a step PLAIN (1 + 0.02 K) for its forward (what the cost model
    prices) and per_token for each drafted token (its proposing, its verify, its share of a forward that skips
    padding), which the proposers' measured seconds tell the cost model. -> the drafts asked of each row, per step."""
    n = len(rows)
    est = est or estimates(n)
    policy, bk = KPolicy(est, enabled=True, max_len=4096), BatchK(est, enabled=batch_k)
    asked_by_step = []
    for _ in range(steps):
        plan = bk.plan(rows, policy.plan(rows, lambda i, cap: None, 64, free=bk.plain_rows(rows)))
        done = [RowStep(k, min(k, accept(r, k)), k + 1) for r, k in zip(rows, plan.asked)]
        wall = PLAIN * (1 + 0.02 * plan.k) + per_token * sum(plan.asked)
        policy.observe_forward(n, plan.k + 1, PLAIN * (1 + 0.02 * plan.k))
        for r, k in zip(rows, plan.asked):
            if k:        # the proposer's seconds, as propose_row measures them
                policy.observe_propose(r.req.stats.method, per_token)
        policy.observe(rows, plan, done, wall=wall)
        bk.observe(rows, plan, done, wall)
        asked_by_step.append(list(plan.asked))
    return asked_by_step


@pytest.mark.parametrize("n", [4, 16])
def test_a_batch_whose_drafting_measures_below_plain_drops_to_k0(n):
    """Every row drafts well (accepts 3 of 4) but each drafted token costs 1.5 / n of a forward: K = 4 yields
    4n tokens where plain yields n, in 1 + 6 = 7 forwards' time. The cost model prices it as a gain; the measured
    rates drop the whole batch to K = 0 within 2 plain steps + MIN_STEPS drafting steps, and keep it there but for
    re-tries (a re-try that loses at once costs one step)."""
    rows = [fake_row("dear") for _ in range(n)]
    asked = run(rows, 300, lambda r, k: min(k, 3), 1.5 * PLAIN / n)
    drafting = [any(a) for a in asked]
    settled = drafting.index(False) + 2 + MIN_STEPS
    assert settled <= 8, drafting[:12]
    assert sum(drafting[settled:]) <= 0.05 * len(drafting[settled:]), drafting
    # negative control: where a drafted token costs a twentieth of that, drafting pays and the batch keeps it
    asked = run([fake_row("dear") for _ in range(n)], 300, lambda r, k: min(k, 3), 0.075 * PLAIN / n)
    assert sum(any(a) for a in asked) > 0.9 * len(asked)


@pytest.mark.parametrize("n", [4, 16])
def test_in_a_mixed_batch_only_the_method_that_pays_keeps_drafting(n):
    """Row 0's method (good) accepts every draft; the other n - 1 rows' (bad) none. A drafted token costs a
    quarter of a forward over n rows: the good row's 4 drafts buy 4 tokens for a sixteenth of a forward at n = 16,
    the bad rows' buy nothing and, all drafting, make the step 2x plain's. With BatchK the bad rows decode
    plainly in the steps where the good row drafts, after a bounded start (a re-try now and then); the policy's
    one K alone drafts every row or none, and priced over all rows it is none (the negative control)."""
    def rows():
        return [fake_row("good")] + [fake_row("bad") for _ in range(n - 1)]

    accept = lambda r, k: k if r.req.stats.method == "good" else 0
    est = estimates(n)
    asked = run(rows(), 300, accept, 0.25 * PLAIN / n, est=est)
    start = next(s for s, a in enumerate(asked) if a[0] and not any(a[1:]))
    assert start <= 12, start
    late = asked[start:]
    assert sum(1 for a in late if a[0]) > 0.9 * len(late)
    assert sum(1 for a in late for k in a[1:] if k) < 0.03 * len(late) * (n - 1)
    good, bad = BatchK(est).rates(("good", "greedy"), n), BatchK(est).rates(("bad", "greedy"), n)   # the read API
    assert good[4] > 1.5 * good[0] and bad[4] < 0.8 * bad[0], (good, bad)
    # negative control: the policy alone
    alone = run(rows(), 300, accept, 0.25 * PLAIN / n, batch_k=False)
    assert all(all(k == a[0] for k in a) for a in alone)
    assert sum(1 for a in alone[start:] if a[0]) < 0.1 * len(late)


def test_the_batch_step_does_not_change_a_batch_of_one_method():
    """A batch of one group is the policy's own class: BatchK leaves its plan as it is (the same object)."""
    rows = [fake_row("good") for _ in range(4)]
    est = estimates(4)
    policy, bk = KPolicy(est, enabled=True, max_len=4096), BatchK(est)
    assert bk.plain_rows(rows) == frozenset()
    plan = policy.plan(rows, lambda i, cap: None, 64)
    assert bk.plan(rows, plan) is plan


# --- through the batch step, on a tiny model ------------------------------------------------------------------


class FakeTime:
    """The injected clock: perf_counter reads `now`, which the scripted forward and proposers advance."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Scripted(ProposerBase):
    """Drafts the plain greedy continuation of its prompt (right) or that shifted by one token (wrong); each
    drafted token advances the injected clock by `per_token`."""

    def __init__(self, answers: dict[tuple, list[int]], right: bool, per_token: float, clock: FakeTime, vocab: int):
        self.name = "scripted"
        self.answers, self.right, self.per_token, self.clock, self.vocab = answers, right, per_token, clock, vocab

    def propose(self, ctx) -> Proposal:
        plen = len(next(iter(self.answers)))
        answer = self.answers[tuple(ctx.tokens[:plen])]
        done = len(ctx.tokens) - plen
        toks = answer[done: done + ctx.k]
        if not self.right:
            toks = [(t + 1) % self.vocab for t in toks]
        self.clock.now += self.per_token * len(toks)
        return Proposal(torch.tensor(toks, dtype=torch.long))

    def observe(self, proposal, result, extra_logits=None) -> None:
        pass

    def lag(self, n_tokens: int) -> int:
        return 0

    def close(self) -> None:
        pass


def batch_run(loaded, monkeypatch, methods: list[str], per_token: dict[str, float], new_tokens: int,
              batch_k: bool = True):
    """Rows of the given methods (good: right drafts, bad: wrong ones, dear: right but dear) through Batch.step
    with the injected clock: a forward over T tokens takes PLAIN (1 + 0.02 (T - 1)), a drafted token per_token of
    its method. batch_k False: the policy's one K alone. -> (each row's tokens, its plain decoding's, its stats)."""
    import leaplm.engine.proposing as proposing
    import leaplm.engine.scoring as scoring
    import leaplm.engine.stats as stats
    from leaplm.engine.engine import Engine
    from leaplm.engine.step import Batch

    target = loaded("llama_tied")
    plain_eng = Engine(target, method="none")
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [[1 + i % 7, 5 + i, 9, 3 + i % 3, 7] for i in range(len(methods))]
    answers = {tuple(p): plain_eng.generate(p, params).token_ids for p in prompts}

    clock = FakeTime()
    monkeypatch.setattr(stats, "time", clock)
    monkeypatch.setattr(scoring, "time", clock)
    monkeypatch.setattr(proposing, "time", clock)         # the proposers' seconds, measured as they are charged
    eng = Engine(target, method="none")
    forward = eng.model.forward

    def timed_forward(ids, *a, **kw):
        clock.now += PLAIN * (1 + 0.02 * (ids.shape[1] - 1))                  # ids [n, T]
        return forward(ids, *a, **kw)

    monkeypatch.setattr(eng.model, "forward", timed_forward)
    if eng.model.capabilities.argmax_head:                 # greedy rows score through the argmax head
        argmax = eng.model.forward_argmax

        def timed_argmax(ids, *a, **kw):
            clock.now += PLAIN * (1 + 0.02 * (ids.shape[1] - 1))
            return argmax(ids, *a, **kw)

        monkeypatch.setattr(eng.model, "forward_argmax", timed_argmax)
    # the start-up calibration's shape, as the clock charges it (an engine of method none skips calibrating)
    eng.estimates.costs.calibrated(len(methods), [{T: PLAIN * (1 + 0.02 * (T - 1)) for T in range(1, 10)}])
    vocab = eng.model.vocab_size
    for m in set(methods):
        right = m != "bad"
        eng._factories[m] = SimpleFactory(
            lambda max_len, right=right, m=m: Scripted(answers, right, per_token[m], clock, vocab))
    batch = Batch(eng, max_rows=len(methods))
    batch.batch_k.enabled = batch_k
    rows = [batch.join(p, params, method=m, k=4)[0] for p, m in zip(prompts, methods)]
    while batch.step() is not None:
        pass
    return ([r.req.tokens[len(p):] for r, p in zip(rows, prompts)], [answers[tuple(p)] for p in prompts],
            [r.req.stats for r in rows])


@pytest.mark.parametrize("n", [4, 16])
def test_batch_step_drops_a_dear_method_to_plain_with_greedy_output(loaded, monkeypatch, n):
    """Every row drafts the right tokens, but each costs 1.5 / n of a forward: the batch decodes plainly after a
    bounded number of drafting steps, and every row's output equals plain decoding's."""
    out, plain, st = batch_run(loaded, monkeypatch, ["dear"] * n, {"dear": 1.5 * PLAIN / n}, 120)
    assert out == plain
    drafting = [s.steps_with_draft for s in st]
    assert 1 <= min(drafting) and max(drafting) <= 2 * MIN_STEPS + 6, drafting     # measured, then a re-try at most
    assert all(s.target_forwards > 100 for s in st)


@pytest.mark.parametrize("n", [4, 16])
def test_batch_step_keeps_drafting_only_on_the_row_whose_method_pays(loaded, monkeypatch, n):
    """Row 0 drafts right tokens, the others wrong ones, a drafted token a quarter of a forward over n rows: the
    good row drafts through most of its steps, the bad rows stop within a bounded number of steps (a re-try now
    and then), and every row's output equals plain decoding's."""
    methods = ["good"] + ["bad"] * (n - 1)
    out, plain, st = batch_run(loaded, monkeypatch, methods, {"good": 0.25 * PLAIN / n, "bad": 0.25 * PLAIN / n},
                               150)
    assert out == plain
    good, bad = st[0], st[1:]
    assert good.steps_with_draft > 0.6 * good.target_forwards, (good.steps_with_draft, good.target_forwards)
    assert good.target_forwards < 0.5 * 150
    assert max(s.steps_with_draft for s in bad) <= 12, [s.steps_with_draft for s in bad]
    # negative control: the policy's one K alone drafts on the bad rows whenever the good row drafts
    out, _, st = batch_run(loaded, monkeypatch, methods, {"good": 0.25 * PLAIN / n, "bad": 0.25 * PLAIN / n}, 150,
                           batch_k=False)
    assert out == plain
    assert min(s.steps_with_draft for s in st[1:]) >= st[0].steps_with_draft > 0, [s.steps_with_draft for s in st]
    assert st[0].target_forwards > good.target_forwards

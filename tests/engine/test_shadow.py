"""Evidence at K = 0 (engine/kpolicy/shadow.py): a row decoding plainly keeps scoring its proposer against the
tokens the target commits, so a request whose first proposals missed returns to speculation once they hit.
Scripted proposers over fake rows and a fixed cost model; deterministic, no model, no timing (one test's scripted
draft sleeps: the policy's budget for scoring guesses reads their seconds)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from leaplm.engine.kpolicy.acceptance import AcceptanceEstimate
from leaplm.engine.kpolicy.estimates import Estimates
from leaplm.engine.kpolicy.policy import KPolicy, RowStep
from leaplm.engine.kpolicy.shadow import SHADOW_CHUNK, ShadowState, resolve_cheap, resolve_guesses
from leaplm.engine.kpolicy.shadow import keep_cheap
from leaplm.engine.row import Row
from leaplm.propose.base import Guesses, Proposal

V = 16
PROMPT = 10


def text(t: int) -> int:
    """The token the target commits at index t."""
    return (3 * t + 1) % V


def costs() -> Estimates:
    """A one-token forward 10 ms, a block of T > 1 tokens 1.5x + 2% a token, a drafted token 0.3 ms."""
    est = Estimates()
    est.costs.calibrated(1, [{T: 1e-2 * (1.0 if T == 1 else 1.5 + 0.02 * T) for T in range(1, 10)}])
    est.observe_propose("draft", 3e-4, rows=1)
    est.draft_prefill_s_per_token = 1e-4
    return est


class ScriptedDraft:
    """A draft-like proposer whose guess of token t is right from index `right_from` on, wrong before."""
    cheap, bursty, group, reads_hidden, samples, reads_target_cache = False, False, None, False, False, False

    def __init__(self, right_from: int, shadows: bool = True, delay_s: float = 0.0):
        self.right_from = right_from
        self.shadows = shadows
        self.delay_s = delay_s            # each scoring's seconds (slept: the policy times it)
        self.cached = 0
        self.fed = 0                      # tokens fed teacher-forced

    def guess(self, t: int) -> int:
        return text(t) if t >= self.right_from else (text(t) + 1) % V

    def lag(self, n: int) -> int:
        return max(0, n - self.cached)

    def guesses(self, tokens: list[int], first: int = 0) -> Guesses | None:
        start, end = min(self.cached, len(tokens) - 1), len(tokens) - 1
        if self.delay_s:
            time.sleep(self.delay_s)
        self.fed += max(0, min(first - 1, end) - start)   # fed without guesses
        start = min(max(start, first - 1), end)
        self.cached = start
        if end <= start:
            return None
        logits = torch.full((end - start, V), -1e9)
        for j in range(end - start):
            logits[j, self.guess(start + j + 1)] = 0.0
        self.fed += end - start
        self.cached = end
        return Guesses(start, logits)


def new_row(proposer, cap: int = 4, verifier: str = "greedy", remaining: int = 400) -> Row:
    req = SimpleNamespace(tokens=[text(t) for t in range(PROMPT)], prompt_ids=list(range(PROMPT)),
                          remaining=remaining, verifier=verifier, seed=None, grammar=None,
                          params=SimpleNamespace(prediction=None),
                          stats=SimpleNamespace(target_forwards=1, method="draft", shadow_s=0.0, decode_s=0.0))
    proc = SimpleNamespace(greedy=lambda logits, presence=None: logits.argmax(-1))
    return Row(req, proc, proposer, cap, acceptance=AcceptanceEstimate(bursty=False))


def step(policy: KPolicy, row: Row, early=None) -> int:
    """One step: the plan's K, the scripted proposer's drafts verified against the text, one commit."""
    plan = policy.plan([row], lambda i, cap: early(len(row.req.tokens), cap) if early else None, 64)
    k = plan.asked[0]
    L = len(row.req.tokens)
    prop = plan.early.get(0) if early else None
    if k and early and 0 not in plan.early:           # not asked before K was chosen: asked now, as the step does
        prop = early(L, k)
    if k and prop is None and not early:
        prop = Proposal(torch.tensor([row.proposer.guess(L + j) for j in range(k)]))
    drafted = min(k, prop.k) if (k and prop is not None) else 0
    acc = 0
    while acc < drafted and int(prop.tokens[acc]) == text(L + acc):
        acc += 1
    row.req.tokens += [text(L + j) for j in range(acc + 1)]
    row.req.remaining -= acc + 1
    row.req.stats.target_forwards += 1
    if drafted and not early:
        row.proposer.cached = L + acc                 # the draft has seen what it drafted and was kept
    secs = 1e-2 * (1.0 if not drafted else 1.5 + 0.02 * (drafted + 1))
    row.req.stats.decode_s += secs
    policy.observe([row], plan, [RowStep(drafted, acc, drafted + 1, prop.match if drafted else None)])
    return drafted


def test_a_draft_that_missed_at_first_returns_to_speculation_once_it_hits():
    """The draft's guesses are wrong for the first 40 tokens, then right. Its first proposals miss, the estimate
    falls and the row decodes plainly; once the guesses hit, the row drafts again within a bounded number of steps
    (a chunk of guesses, a proposal's window, a few steps of evidence), and keeps drafting."""
    switch = PROMPT + 40
    proposer = ScriptedDraft(right_from=switch)
    row, policy = new_row(proposer), KPolicy(costs(), enabled=True, max_len=4096)
    drafted = []
    while len(row.req.tokens) < switch:
        drafted.append(step(policy, row))
    assert sum(1 for d in drafted[-16:] if d) <= 2, drafted   # missing: plain decoding, a try at most
    steps_back = None
    for s in range(60):
        if step(policy, row) and steps_back is None:
            steps_back = s
    assert steps_back is not None and steps_back <= 2 * SHADOW_CHUNK + 4 + 6, steps_back
    late = [step(policy, row) for _ in range(20)]
    assert sum(1 for d in late if d) >= 18, late
    assert row.req.stats.shadow_s >= 0.0 and proposer.fed > 0


def test_without_guesses_the_same_row_waits_for_a_try():
    """The negative control: the same script with a proposer that cannot score guesses learns only from tries at
    K > 0, and is still at K = 0 where the scored one is drafting again (no step here tells the measured rates its
    wall time, so nothing tries K > 0)."""
    switch = PROMPT + 40
    proposer = ScriptedDraft(right_from=switch, shadows=False)
    row, policy = new_row(proposer), KPolicy(costs(), enabled=True, max_len=4096)
    while len(row.req.tokens) < switch:
        step(policy, row)
    back = [step(policy, row) for _ in range(2 * SHADOW_CHUNK + 4 + 6)]
    assert not any(back), back


@pytest.mark.parametrize("constrained", [True, False])
def test_scoring_guesses_stays_within_its_share_of_the_rows_decoding(constrained):
    """A draft whose scoring costs 6 ms a chunk of 8 tokens (7.5% of eight 10 ms plain steps): a row scores guesses
    only while their seconds stay within SHADOW_SHARE of its decoding so far, a constrained row within
    SHADOW_BUDGET (its forced tokens fill chunks fast), one scoring's overshoot at most; both still score some.
    The guesses are wrong throughout, so the row stays at K = 0. The unconstrained row spends more than the
    constrained row's share (the two limits differ)."""
    from leaplm.engine.kpolicy.shadow import SHADOW_BUDGET, SHADOW_SHARE

    proposer = ScriptedDraft(right_from=10 ** 9, delay_s=6e-3)
    row, policy = new_row(proposer, remaining=2000), KPolicy(costs(), enabled=True, max_len=4096)
    row.req.grammar = object() if constrained else None
    for _ in range(300):
        step(policy, row)
    stats = row.req.stats
    share = SHADOW_BUDGET if constrained else SHADOW_SHARE
    assert stats.shadow_s > 0 and proposer.fed > 0
    assert stats.shadow_s <= share * stats.decode_s + 0.01, (stats.shadow_s, stats.decode_s)
    if not constrained:
        assert stats.shadow_s > SHADOW_BUDGET * stats.decode_s + 0.01, (stats.shadow_s, stats.decode_s)


def test_a_constrained_request_weighs_a_catching_up_against_the_tokens_it_has_produced():
    """What a draft's catching up paid at once (a prompt fed for evidence, a try's prefill) is weighed against:
    an unconstrained request's remaining budget; a constrained one's grammar usually ends it long before its
    budget, so at most as many tokens as it has produced so far."""
    from leaplm.engine.kpolicy.shadow import tokens_left

    def req(produced: int, grammar) -> SimpleNamespace:
        return SimpleNamespace(prompt_ids=[0] * 50, tokens=[0] * (50 + produced), remaining=96 - produced,
                               grammar=grammar)

    assert tokens_left(req(4, None)) == 92
    assert tokens_left(req(4, object())) == 4
    assert tokens_left(req(0, object())) == 1
    assert tokens_left(req(60, object())) == 36


def test_an_ngram_proposal_at_k0_is_compared_with_the_tokens_that_follow():
    """A cheap proposer's proposals made at K = 0 are resolved as the tokens come: agreeing tokens count as
    accepted, the first disagreeing one ends the run; a proposal waits until its outcome is known."""
    st = ShadowState()
    keep_cheap(st, 5, [7, 8, 9], match=3)
    assert resolve_cheap(st, [0] * 5 + [7, 8]) == []                     # 2 of 3 known, both agree: wait
    assert resolve_cheap(st, [0] * 5 + [7, 8, 1]) == [([1.0, 1.0, 0.0], 3)]
    keep_cheap(st, 5, [6, 8], match=None)
    assert resolve_cheap(st, [0] * 5 + [7]) == [([0.0, 0.0], None)]       # a wrong first token: known at once


def test_long_right_proposals_at_k0_are_counted_not_pushed_out():
    """Proposals longer than the pending list (a prediction drafts 32 tokens) made at K = 0 step after step, all
    right: each is resolved as right before later ones push it out, so the evidence is not misses only."""
    from leaplm.engine.kpolicy.shadow import MAX_PENDING

    text = list(range(100, 300))
    st, out = ShadowState(), []
    for t in range(3 * MAX_PENDING):                    # K = 0: one token committed per step
        keep_cheap(st, t, text[t:t + 2 * MAX_PENDING], match=None)
        out += resolve_cheap(st, text[:t + 1])
    assert out and all(passed == [1.0] * len(passed) for passed, _ in out)
    assert len(out) >= 3 * MAX_PENDING - MAX_PENDING - 1 and len(st.pending) <= MAX_PENDING


def test_a_cheap_proposer_that_missed_returns_to_speculation_once_it_hits():
    """An n-gram-like proposer (cheap, bursty) that proposes at every step: wrong for the first 40 tokens, then
    right. At K = 0 its proposals are still compared with what is committed, so it drafts again within a few
    steps of starting to hit."""
    switch = PROMPT + 40
    proposer = SimpleNamespace(cheap=True, bursty=True, group=None, reads_hidden=False, shadows=False,
                               lag=lambda n: 0)
    row = new_row(proposer)
    row.acceptance = AcceptanceEstimate(bursty=True)
    policy = KPolicy(costs(), enabled=True, max_len=4096)

    def early(L: int, cap: int) -> Proposal:
        toks = [text(L + j) if L + j >= switch else (text(L + j) + 1) % V for j in range(cap)]
        return Proposal(torch.tensor(toks), match=2)

    while len(row.req.tokens) < switch:
        step(policy, row, early)
    back = None
    for s in range(40):
        if step(policy, row, early) and back is None:
            back = s
    assert back is not None and back <= 8, back


@pytest.mark.parametrize("cap", [1, 3])
def test_would_be_proposals_count_the_run_of_right_guesses(cap):
    """A proposal starting at t keeps the run of right teacher-forced guesses from t (at most cap); one is counted
    once its window is scored or a wrong guess ends it."""
    st = ShadowState()
    st.right = {10: 1.0, 11: 1.0, 12: 0.0, 13: 1.0}
    out = resolve_guesses(st, cap)
    expect = {1: [[1.0], [1.0], [0.0], [1.0]],
              3: [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]}[cap]
    assert out == expect
    st.right.update({14: 1.0, 15: 1.0})
    if cap == 3:
        assert resolve_guesses(st, cap) == [[1.0, 1.0, 1.0]]


def test_rejection_sampling_evidence_is_a_probability():
    """Under rejection sampling a guess is right with probability sum min(p, q): passed is their running product."""
    st = ShadowState()
    st.right = {20: 0.5, 21: 0.8}
    assert resolve_guesses(st, 2) == [[0.5, pytest.approx(0.4)]]
    est = AcceptanceEstimate(bursty=False)
    before = est.tokens_by_k(2)
    est.observe_expected([0.5, 0.4])
    assert est.tokens_by_k(2)[2] < before[2]

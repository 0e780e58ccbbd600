"""BatchScheduler (continuous batching) against the single-request Engine, in the test process (no server)."""
from __future__ import annotations

import pytest
import torch

from leaplm import Engine, SamplingParams
from leaplm.engine.kpolicy.acceptance import expected_tokens
from leaplm.engine.scheduler import BatchScheduler, QueueFull, SchedulerClosed, SeqRequest
from leaplm.verify import VerifyResult

PROMPTS = ["the quick brown fox", "déjà vu", "def add(a, b):", "東京 と 大阪", "speculative decoding",
           "un café crème", "🙂", "größer über"]


def run(sched: BatchScheduler, prompts, params, **seq_kw) -> list[dict]:
    """Submit every prompt at once, step until idle; per request: tokens, text, finish reason, stats, error."""
    eng = sched.engine
    outs: dict[int, list] = {}
    seqs = []
    for i, p in enumerate(prompts):
        ids = eng.encode(p, params[i] if isinstance(params, list) else params)
        seqs.append(SeqRequest(ids, params[i] if isinstance(params, list) else params,
                               on_output=lambda o, i=i: outs.setdefault(i, []).append(o), **seq_kw))
    sched.submit(seqs)
    sched.run_until_idle()
    res = []
    for i in range(len(prompts)):
        evs = outs[i]
        chunks = [e.chunk for e in evs if e.chunk is not None]
        res.append({"tokens": [t for c in chunks for t in c.token_ids], "text": "".join(c.text for c in chunks),
                    "finish": chunks[-1].finish_reason if chunks else None,
                    "stats": chunks[-1].stats if chunks else None, "error": evs[-1].error,
                    "logprobs": [lp for c in chunks for lp in (c.logprobs or [])]})
    return res


@pytest.fixture(scope="module")
def target(loaded):
    return loaded("llama_tied")


@pytest.fixture(scope="module")
def reference(target):
    return Engine(target, method="none")


def engine_for(target, loaded, method: str, k: int = 4, adaptive: bool = False) -> Engine:
    if method == "draft-self":     # the target as its own draft: every draft accepted, blocks of K + 1 tokens
        return Engine(target, draft=target, method="draft", k=k, adaptive_k=adaptive)
    if method == "draft":
        return Engine(target, draft=loaded("llama_draft"), method="draft", k=k, adaptive_k=adaptive)
    if method == "layerskip":      # the tiny target has 2 layers: skip the second
        return Engine(target, method=method, k=k, adaptive_k=adaptive, skip_layers=[1])
    return Engine(target, method=method, k=k, adaptive_k=adaptive)


@pytest.mark.parametrize("method", ["none", "draft", "draft-self", "ngram", "suffix", "lookahead", "layerskip"])
def test_batched_greedy_equals_single_request_none(target, loaded, reference, method):
    params = SamplingParams(max_new_tokens=40, temperature=0)
    refs = [reference.generate(p, params) for p in PROMPTS]
    sched = BatchScheduler(engine_for(target, loaded, method), max_batch=4, calibrate=False)
    for got, ref in zip(run(sched, PROMPTS, params), refs):
        assert got["error"] is None
        assert got["tokens"] == ref.token_ids
        assert got["text"] == ref.text
        assert got["finish"] == ref.finish_reason
    assert sched.rows_in_use == 0 and sched.cached_tokens == 0 and sched.running == 0


def test_rows_of_different_lengths_join_and_leave(target, loaded, reference):
    """Different max_new_tokens: requests leave at different steps and waiting ones take their rows."""
    params = [SamplingParams(max_new_tokens=3 + 7 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    sched = BatchScheduler(engine_for(target, loaded, "draft-self"), max_batch=3, calibrate=False)
    for got, p, prm in zip(run(sched, PROMPTS, params), PROMPTS, params):
        ref = reference.generate(p, prm)
        assert got["tokens"] == ref.token_ids and len(got["tokens"]) == prm.max_new_tokens
        assert got["finish"] == "length"


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(target, loaded):
    eng = engine_for(target, loaded, "draft", adaptive=True)
    p = SamplingParams(max_new_tokens=30, temperature=0.9, seed=11)
    alone = run(BatchScheduler(eng, max_batch=1, calibrate=False), PROMPTS[:1], p)[0]
    crowd = run(BatchScheduler(eng, max_batch=8), PROMPTS[:1] * 5 + PROMPTS[1:4], p)
    assert all(c["tokens"] == alone["tokens"] for c in crowd[:5])
    assert alone["stats"].draft_tokens > 0


def test_sampling_without_speculation_equals_the_engine(target, reference):
    """Method none draws exactly what the single-request engine draws: one generator per request."""
    sched = BatchScheduler(Engine(target, method="none"), max_batch=4, calibrate=False)
    params = [SamplingParams(max_new_tokens=25, temperature=1.0, top_k=20, seed=i) for i in range(len(PROMPTS))]
    for got, p, prm in zip(run(sched, PROMPTS, params), PROMPTS, params):
        assert got["tokens"] == reference.generate(p, prm).token_ids


def test_stop_token_inside_an_accepted_block(target, loaded, reference):
    """With the target as draft every step accepts K tokens; a stop id in the middle of a block ends the output
    just before it, with finish_reason 'stop', and nothing after it is returned."""
    base = reference.generate(PROMPTS[0], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
    stop_at = 6
    stop_id = base.token_ids[stop_at]
    first = base.token_ids.index(stop_id)
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    sched = BatchScheduler(engine_for(target, loaded, "draft-self", k=5), max_batch=2, calibrate=False)
    got = run(sched, PROMPTS[:1], params)[0]
    assert got["tokens"] == base.token_ids[:first]
    assert got["finish"] == "stop"
    assert got["stats"].mean_accepted_length > 1


def test_stop_string_inside_an_accepted_block(target, loaded, reference):
    base = reference.generate(PROMPTS[2], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
    stop = base.text[8:11]
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    sched = BatchScheduler(engine_for(target, loaded, "draft-self", k=5), max_batch=2, calibrate=False)
    got = run(sched, PROMPTS[2:3], params)[0]
    assert got["text"] == base.text[: base.text.index(stop)]
    assert got["finish"] == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 5, 6, 7, 11])
def test_max_new_tokens_holds_exactly(target, loaded, max_new):
    params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    sched = BatchScheduler(engine_for(target, loaded, "draft-self", k=4), max_batch=4, calibrate=False)
    for got in run(sched, PROMPTS[:4], params):
        assert len(got["tokens"]) == max_new and got["finish"] == "length"


def test_logprobs_match_the_single_request_engine(target, loaded, reference):
    params = SamplingParams(max_new_tokens=12, temperature=0, logprobs=2)
    sched = BatchScheduler(engine_for(target, loaded, "draft-self"), max_batch=4, calibrate=False)
    for got, p in zip(run(sched, PROMPTS[:4], params), PROMPTS[:4]):
        ref = reference.generate(p, params)
        assert [lp.token_id for lp in got["logprobs"]] == [lp.token_id for lp in ref.logprobs]
        assert [lp.logprob for lp in got["logprobs"]] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)


def test_prompt_logprobs(target, reference):
    sched = BatchScheduler(Engine(target, method="none"), max_batch=2, calibrate=False)
    ids = reference.encode(PROMPTS[0], SamplingParams())
    outs = []
    sched.submit([SeqRequest(ids, SamplingParams(max_new_tokens=2, temperature=0), outs.append, prompt_logprobs=2)])
    sched.run_until_idle()
    plp = outs[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    logits = target.model(torch.tensor([ids]), target.model.new_cache(1, 64))[0]
    want = torch.log_softmax(logits, -1)
    for j in range(1, len(ids)):
        assert plp[j].token_id == ids[j]
        assert plp[j].logprob == pytest.approx(float(want[j - 1, ids[j]]), abs=1e-4)
        assert len(plp[j].top) == 2


def test_abort_frees_the_row_at_the_next_step(target, loaded, reference):
    sched = BatchScheduler(engine_for(target, loaded, "draft"), max_batch=4, calibrate=False)
    params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    outs: dict[int, list] = {}
    seqs = [SeqRequest(reference.encode(p, params), params, lambda o, i=i: outs.setdefault(i, []).append(o))
            for i, p in enumerate(PROMPTS[:4])]
    sched.submit(seqs)
    for _ in range(3):
        sched.step()
    assert sched.running == 4 and sched.rows_in_use == 4
    sched.abort(seqs[1])
    sched.abort(seqs[3])
    before = len(outs[1])
    sched.step()
    assert sched.running == 2 and sched.rows_in_use == 2
    assert outs[1][-1].error == "aborted" and len(outs[1]) == before + 1
    sched.run_until_idle()
    assert sched.rows_in_use == 0 and sched.cached_tokens == 0
    # the survivors, which moved rows, are unaffected
    for i in (0, 2):
        ref = reference.generate(PROMPTS[i], params)
        assert [t for o in outs[i] if o.chunk for t in o.chunk.token_ids] == ref.token_ids


def test_queue_bound_and_close(target):
    sched = BatchScheduler(Engine(target, method="none"), max_batch=1, max_queue=2, calibrate=False)
    mk = lambda: SeqRequest([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0), lambda o: None)  # noqa: E731
    sched.submit([mk(), mk()])
    with pytest.raises(QueueFull):
        sched.submit([mk()])
    sched.run_until_idle()
    sched.submit([mk()])
    sched.close_admission()
    with pytest.raises(SchedulerClosed):
        sched.submit([mk()])


def test_admits_next_while_a_request_waits_for_a_free_row(target):
    sched = BatchScheduler(Engine(target, method="none"), max_batch=1, max_queue=2, calibrate=False)
    mk = lambda n: SeqRequest([1, 2, 3], SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True),  # noqa: E731
                              lambda o: None)
    assert not sched.admits_next
    sched.submit([mk(3), mk(3)])
    assert sched.admits_next                  # a free row and a request for it
    sched.step()
    assert sched.running == 1 and sched.queue_depth == 1 and not sched.admits_next     # waiting, no free row
    sched.step()
    sched.step()                              # the first request's last token: its row is free again
    assert sched.running == 0 and sched.admits_next
    sched.run_until_idle()
    assert not sched.admits_next


def test_threaded_loop_serves_and_stops(target, reference):
    import threading

    sched = BatchScheduler(Engine(target, method="none"), max_batch=4, calibrate=False)
    sched.start()
    done = threading.Event()
    got = []
    params = SamplingParams(max_new_tokens=10, temperature=0)

    def on(o):
        got.append(o)
        if o.finished:
            done.set()
    sched.submit([SeqRequest(reference.encode(PROMPTS[0], params), params, on)])
    assert done.wait(30)
    assert [t for o in got if o.chunk for t in o.chunk.token_ids] == reference.generate(PROMPTS[0], params).token_ids
    sched.stop(timeout=10)
    assert not sched._thread.is_alive()


# --- the K policy with a real draft (the pure policy: test_adaptive.py) -------------------------------------------
def test_scheduler_spreads_the_draft_catch_up_over_the_remaining_steps(target, loaded):
    sched = BatchScheduler(engine_for(target, loaded, "draft", adaptive=True), max_batch=2)
    assert sched.draft_prefill_s_per_token > 0             # calibrated with the target costs
    prompt = list(range(1, 41))
    sched.submit([SeqRequest(prompt, SamplingParams(max_new_tokens=30, temperature=0), lambda o: None)])
    sched.step()                                           # the first step never drafts
    row = sched._running[0]
    assert row.proposer.lag(len(row.req.tokens)) == len(row.req.tokens) == 41   # nothing cached: the whole context
    want = 41 * sched.draft_prefill_s_per_token / (row.req.remaining / expected_tokens(row.acceptance.rate, 4))
    assert sched.batch.catchup_s(row) == pytest.approx(want)
    prop, _ = sched.batch._propose(0, row, 2)               # once it has drafted, only the new tokens remain
    assert row.proposer.lag(len(row.req.tokens)) == 0 and sched.batch.catchup_s(row) == 0.0
    row.proposer.observe(prop, VerifyResult([prop.tokens.tolist()[0]], 0))   # as a step would: nothing accepted
    sched.run_until_idle()


def test_the_draft_cost_per_token_leaves_out_its_catching_up(target, loaded, monkeypatch):
    """After steps at K = 0 the draft has tokens to catch up on before it drafts; that prefill is priced apart
    (catchup_s), so the cost per drafted token must not include it, or every probe after a stretch at K = 0 would
    price drafting dearer and keep K at 0. A clock that ticks once per draft forward: a catch-up of 40 tokens
    (one forward, alone) and 2 drafted tokens (two forwards) cost 1 per drafted token, not 1.5."""
    import time
    sched = BatchScheduler(engine_for(target, loaded, "draft", adaptive=True), max_batch=1, calibrate=False)
    sched.submit([SeqRequest(list(range(1, 41)), SamplingParams(max_new_tokens=30, temperature=0), lambda o: None)])
    sched.step()                                           # the first step never drafts: 41 tokens unseen
    row = sched._running[0]
    group = row.proposer.group
    clock = [0.0]

    class Ticking:                                         # the draft model, one clock tick per forward
        def __init__(self, model):
            self.model = model

        def __call__(self, *a, **kw):
            clock[0] += 1.0
            return self.model(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.model, name)

    monkeypatch.setattr(group, "model", Ticking(group.model))
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    est = sched.engine.estimates
    est.propose_s.clear()
    est.propose_s_rows.clear()
    props, _ = sched.batch._propose_all([2])
    assert props[0].k == 2 and props[0].catchup_s == 1.0
    assert est.propose_cost("draft", 1) == 1.0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_cheap_proposers_propose_before_k_is_chosen(target, loaded, reference, method, monkeypatch):
    """n-gram and suffix proposals cost next to nothing: the step asks for one at the row's cap before choosing K,
    so the policy sees each row certain to have a proposal (or none: cap 0), K at most its length, priced by its
    match length, its cost already spent; the proposal is then trimmed to K (a tree to its first K nodes).
    Output stays plain decoding's."""
    from leaplm.engine.kpolicy import adaptive, priors
    seen = []
    choose = adaptive.BatchAdaptiveK.choose

    def spy(self, rows):
        k = choose(self, rows)
        seen.append((rows, k))
        return k

    monkeypatch.setattr(adaptive.BatchAdaptiveK, "choose", spy)
    monkeypatch.setattr(priors, "PROCESS_PRIORS", {})      # what earlier tests measured of n-gram does not carry
    prompt = "abc abc abc abc abc abc abc abc"
    params = SamplingParams(max_new_tokens=40, temperature=0)
    eng = engine_for(target, loaded, method, k=6, adaptive=True)
    got = eng.generate(prompt, params)
    assert got.token_ids == reference.generate(prompt, params).token_ids
    in_hand = [(rows[0], k) for rows, k in seen if rows and rows[0].cap and rows[0].match == 1.0]
    assert in_hand, "the proposer never had a proposal"
    assert all(r.propose_s_per_token == 0.0 and r.cap <= 6 for r, _ in in_hand)
    assert got.stats.draft_tokens > 0


def test_cheap_proposers_propose_early_every_few_steps_while_the_batch_decodes_plainly(target, loaded,
                                                                                      monkeypatch):
    """At K = 0 an n-gram row of a batch of EARLY_ROWS rows or more is asked before K is chosen on one step in
    EARLY_EVERY (its lookups and their pricing are most of what it costs there); the row is priced without a
    proposal in hand on the others. A smaller batch is asked every step."""
    from leaplm.engine.kpolicy import adaptive, policy
    from leaplm.engine.kpolicy.measured import RateBandit
    seen = []
    choose = adaptive.BatchAdaptiveK.choose

    def plain(self, rows):                        # the cost model says K = 0 on every step
        choose(self, rows)
        seen.append(rows[0].match == 1.0 if rows and rows[0].cap else None)
        return 0

    monkeypatch.setattr(adaptive.BatchAdaptiveK, "choose", plain)
    monkeypatch.setattr(RateBandit, "decide", lambda self, key, k, alt=None: k)
    monkeypatch.setattr(policy, "EARLY_ROWS", 1)              # the rule of a batch of EARLY_ROWS, on one row
    params = SamplingParams(max_new_tokens=31, temperature=0)
    got = engine_for(target, loaded, "ngram", k=6, adaptive=True).generate("abc abc abc abc abc abc", params)
    assert got.stats.draft_tokens == 0
    asked = [i for i, m in enumerate(seen) if m is not None]
    early = [i for i in asked if seen[i]]
    assert len(asked) >= 20 and 0 < len(early) <= len(asked) // policy.EARLY_EVERY + 1, seen
    # control: a batch below EARLY_ROWS is asked every step: the same count sees the proposal in hand on most steps
    seen.clear()
    monkeypatch.setattr(policy, "EARLY_ROWS", 2)
    engine_for(target, loaded, "ngram", k=6, adaptive=True).generate("abc abc abc abc abc abc", params)
    asked = [i for i, m in enumerate(seen) if m is not None]
    assert len([i for i in asked if seen[i]]) > len(asked) // 3 + 1, seen


def test_a_row_near_its_context_end_caps_only_its_own_drafts(target):
    """The batched forward writes 1 + K slots to every row; with slots (and positions) past max_model_len for the
    padding, a row with 2 tokens of room drafts at most 2 while the other row still drafts its K = 4 (every
    draft of the target drafting for itself is accepted). Output stays the rows' plain decoding."""
    from leaplm.engine.step import Batch
    eng = Engine(target, draft=target, method="draft", k=4, adaptive_k=False, max_model_len=48)
    ref = Engine(target, method="none", max_model_len=48)
    batch = Batch(eng, max_rows=2)
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    near, far = list(range(1, 46)), [3, 1, 4, 1, 5]           # room after the first token: 48 - 45 - 1 = 2
    batch.join(near, params)
    batch.join(far, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    outcome = batch.step()
    assert outcome.report.drafted == [2, 4]
    tokens = {0: [], 1: []}
    for out in outcome.outputs:
        tokens[0 if out.row.req.prompt_ids == near else 1] += out.chunk.token_ids
    while batch.rows:
        for out in batch.step().outputs:
            tokens[0 if out.row.req.prompt_ids == near else 1] += out.chunk.token_ids
    assert tokens[0] == ref.generate(near, params).token_ids
    assert tokens[1] == ref.generate(far, SamplingParams(max_new_tokens=20, temperature=0,
                                                         ignore_eos=True)).token_ids


def test_without_positions_past_the_context_a_row_near_its_end_caps_the_step(target):
    """At the model's own context limit (256 positions here) there is no slot for padding past it: the step's K
    is what the fullest row's cache can take (256 - 253 = 3 slots after its last token)."""
    from leaplm.engine.step import Batch
    eng = Engine(target, draft=target, method="draft", k=4, adaptive_k=False)
    assert eng.max_model_len == target.model.max_len == 256
    batch = Batch(eng, max_rows=2)
    batch.join(list(range(1, 254)), SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    batch.join([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    assert batch.step().report.drafted == [2, 3]


def test_calibration_between_requests_serves_at_once_and_ends_calibrated(target, loaded, reference, monkeypatch,
                                                                         tmp_path):
    """calibrate='idle' with an empty start-up cache: the scheduler answers before any batch size is measured,
    outputs stay identical, the loop thread measures every size while idle, and the next scheduler reads them from
    the cache without measuring."""
    import threading

    from leaplm import startup_cache
    from leaplm.engine import scheduler as sched_mod

    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path))
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)
    eng = engine_for(target, loaded, "draft-self", k=3, adaptive=True)
    sched = BatchScheduler(eng, max_batch=4, calibrate="idle")
    assert sched.pending_calibration == [n for n in (1, 2, 4) if n not in eng.estimates.calibrated_rows]
    measured = []
    real = sched_mod.cached_calibrate
    monkeypatch.setattr(sched_mod, "cached_calibrate", lambda e, n, *a: (measured.append(n), real(e, n, *a))[1])
    params = SamplingParams(max_new_tokens=12, temperature=0)
    got, done = [], threading.Event()
    seq = SeqRequest(eng.encode(PROMPTS[0], params), params,
                     on_output=lambda o: (got.append(o), o.finished and done.set()))
    sched.submit([seq])                               # waiting before the loop starts: served before calibrating
    sched.start()
    assert done.wait(60)
    assert [t for o in got if o.chunk for t in o.chunk.token_ids] == reference.generate(PROMPTS[0], params).token_ids
    for _ in range(600):
        if not sched.pending_calibration:
            break
        threading.Event().wait(0.1)
    sched.stop()
    assert sched.pending_calibration == [] and measured and {1, 2, 4} <= eng.estimates.calibrated_rows
    again = engine_for(target, loaded, "draft-self", k=3, adaptive=True)
    assert BatchScheduler(again, max_batch=4, calibrate="idle").pending_calibration == []
    assert startup_cache.cache_root().exists()

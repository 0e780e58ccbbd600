"""Seeded reproducibility through the one step: a seeded request's tokens depend on its seed alone, not on the
method, K (fixed or chosen by the adaptive controller), or what else shares its batch (other rows' remaining room
included). Greedy output does not depend on the batch either (test_scheduler.py). See sampling/positional.py."""
from __future__ import annotations

import pytest

from leaplm import Engine, SamplingParams
from leaplm.config import ConfigError
from leaplm.engine.scheduler import BatchScheduler, SeqRequest

PROMPT = "the quick brown fox"
SAMPLED = dict(max_new_tokens=30, temperature=0.8, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def target(loaded):
    return loaded("llama_tied")


@pytest.fixture(scope="module")
def plain(target):
    return Engine(target, method="none")


def spec_engines(target, loaded):
    yield "draft-self k=1", Engine(target, draft=target, method="draft", k=1, adaptive_k=False)
    yield "draft-self k=6", Engine(target, draft=target, method="draft", k=6, adaptive_k=False)
    yield "draft k=3", Engine(target, draft=loaded("llama_draft"), method="draft", k=3, adaptive_k=False)
    yield "draft adaptive", Engine(target, draft=loaded("llama_draft"), method="draft", k=5, adaptive_k=True)
    yield "ngram adaptive", Engine(target, method="ngram", k=4, adaptive_k=True)
    yield "suffix k=4", Engine(target, method="suffix", k=4, adaptive_k=False)
    yield "lookahead k=4", Engine(target, method="lookahead", k=4, adaptive_k=False)


def test_a_seed_gives_the_same_tokens_for_every_method_and_k(target, loaded, plain):
    params = SamplingParams(seed=5, **SAMPLED)
    want = plain.generate(PROMPT, params).token_ids
    assert plain.generate(PROMPT, SamplingParams(seed=6, **SAMPLED)).token_ids != want     # the seed matters
    for name, eng in spec_engines(target, loaded):
        out = eng.generate(PROMPT, params)
        assert out.token_ids == want, name
        assert eng.generate(PROMPT, params).token_ids == want, name                         # and again
        if name.startswith("draft-self"):        # the target as its own draft: speculation really ran
            assert out.stats.accepted_tokens > 0 and out.stats.mean_accepted_length > 1.5, name


def test_a_seed_gives_the_same_tokens_inside_a_mixed_batch_of_8(target, loaded, plain):
    """Alone (Engine.generate, a batch of one) and as one row of 8: greedy rows, other seeds, other methods and
    K, and a row near the end of the context (which caps the step's K for every row)."""
    eng = Engine(target, draft=loaded("llama_draft"), method="draft", k=5, adaptive_k=True)
    params = SamplingParams(seed=11, **SAMPLED)
    alone = eng.generate(PROMPT, params).token_ids
    assert alone == plain.generate(PROMPT, params).token_ids
    sched = BatchScheduler(eng, max_batch=8)
    long_ids = [(7 * i) % 300 + 1 for i in range(eng.max_model_len - 12)]   # 10 tokens of room: caps K
    others = [
        (PROMPT, SamplingParams(max_new_tokens=30, temperature=0), None, None),
        ("déjà vu", SamplingParams(seed=3, **SAMPLED), "ngram", 3),
        (PROMPT, SamplingParams(seed=12, **SAMPLED), "none", None),
        (long_ids, SamplingParams(max_new_tokens=10, temperature=0.7, seed=1, ignore_eos=True), "draft", 8),
        ("def add(a, b):", SamplingParams(max_new_tokens=20, temperature=0), "suffix", 2),
        (PROMPT, SamplingParams(seed=11, **SAMPLED), "lookahead", 4),
        ("un café crème", SamplingParams(seed=2, max_new_tokens=5, temperature=1.2), None, 1),
    ]
    outs: dict[int, list[int]] = {}
    seqs = []
    for i, (prompt, prm, method, k) in enumerate([(PROMPT, params, None, None)] + others):
        ids = prompt if isinstance(prompt, list) else eng.encode(prompt, prm)
        seqs.append(SeqRequest(ids, prm, lambda o, i=i: outs.setdefault(i, []).extend(o.chunk.token_ids if o.chunk
                                                                                       else []), method=method, k=k))
    sched.submit(seqs)
    sched.run_until_idle()
    assert outs[0] == alone
    assert outs[6] == alone                       # the same seed through lookahead, in the same batch
    assert outs[1] == plain.generate(PROMPT, others[0][1]).token_ids


def test_seeds_use_all_64_bits(plain):
    base = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    run = lambda s: plain.generate(PROMPT, SamplingParams(**{**base.__dict__, "seed": s})).token_ids  # noqa: E731
    s = 12345
    assert run(s) != run(s + 2**32) != run(s + 2**63)
    assert run(-1) == run(2**64 - 1)             # negative seeds are their two's complement
    for bad in (2**64, -(2**63) - 1, 10**30):
        with pytest.raises(ConfigError) as e:
            SamplingParams(seed=bad)
        assert e.value.field == "seed"


def test_a_request_can_turn_the_k_policy_off(target, loaded):
    """SeqRequest.adaptive_k=False (the server's speculative.adaptive_k): the row drafts its K every step, the
    others in the batch keep the policy's K; the seeded tokens are the same either way."""
    eng = Engine(target, draft=target, method="draft", k=5, adaptive_k=True)
    params = SamplingParams(seed=9, **SAMPLED)
    got = {}
    sched = BatchScheduler(eng, max_batch=2, calibrate=False)
    ids = eng.encode(PROMPT, params)
    for name, adaptive in (("fixed", False), ("policy", None)):
        sched.submit([SeqRequest(ids, params, lambda o, n=name: got.setdefault(n, []).append(o), k=3,
                                 adaptive_k=adaptive)])
    sched.run_until_idle()
    fixed = [o.chunk for o in got["fixed"] if o.chunk is not None]
    st = fixed[-1].stats
    assert st.steps_with_draft == st.target_forwards and st.draft_tokens >= 3 * (st.target_forwards - 1)
    assert [t for c in fixed for t in c.token_ids] == [t for o in got["policy"] if o.chunk for t in o.chunk.token_ids]

"""Engine.generate_batch (`leaplm generate -n N`): N sequences of one prompt as the N rows of one batch, through
the same step as everything else. Greedy rows equal a request alone; seeded sampled rows (verified by the race)
equal the same seed alone, whatever else is in the batch; one batched forward per step serves every row."""
from __future__ import annotations

import pytest

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine

PROMPT = [5, 9, 2, 7, 7, 3]


@pytest.fixture(scope="module")
def target(loaded):
    return loaded("llama_tied")


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_greedy_rows_equal_a_request_alone(target, loaded, method):
    draft = loaded("llama_draft") if method == "draft" else None
    eng = Engine(target, draft=draft, method=method, k=3)
    params = [SamplingParams(max_new_tokens=20 + 3 * i, temperature=0, ignore_eos=True) for i in range(3)]
    outs = eng.generate_batch(PROMPT, params)
    assert [o.token_ids for o in outs] == [eng.generate(PROMPT, p).token_ids for p in params]
    assert [len(o.token_ids) for o in outs] == [20, 23, 26]


def test_seeded_rows_equal_the_seed_alone(target, loaded):
    eng = Engine(target, draft=loaded("llama_draft"), method="draft", k=3, adaptive_k=False)
    params = [SamplingParams(max_new_tokens=24, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(4)]
    outs = eng.generate_batch(PROMPT, params)
    assert [o.token_ids for o in outs] == [eng.generate(PROMPT, p).token_ids for p in params]
    assert len({tuple(o.token_ids) for o in outs}) > 1                    # different seeds, different samples


def test_rows_share_the_target_forwards(target, monkeypatch):
    """Three rows of 16 tokens without speculation: 16 steps of one batched forward, not 48 forwards in turn."""
    eng = Engine(target, method="none")
    calls = []

    def counting(forward):
        def run(*a, **kw):
            calls.append(a[0].shape[0])                                   # rows in this forward
            return forward(*a, **kw)
        return run

    # greedy rows whose logits nothing reads are scored by forward_argmax (engine/scoring.py)
    for name in ("forward", "forward_argmax"):
        monkeypatch.setattr(eng.model, name, counting(getattr(eng.model, name)))
    outs = eng.generate_batch(PROMPT, [SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)] * 3)
    assert all(len(o.token_ids) == 16 for o in outs)
    assert calls.count(3) == 16 and len(calls) == 16 + 3                  # 3 prefills (one row each), 16 steps

"""Chunked prefill (max_num_batched_tokens): a long prompt goes in over several steps between decoding steps of the
running rows, and nothing about any output changes."""
from __future__ import annotations

import pytest

from leaplm import Engine, SamplingParams
from leaplm.config import ConfigError
from leaplm.engine.scheduler import BatchScheduler, SeqRequest
from leaplm.engine.table import MIN_CHUNK

LONG = [3 + (i * 7) % 200 for i in range(150)]            # a 150-token prompt of byte-level ids
SHORT = ["the quick brown fox", "déjà vu", "def add(a, b):", "speculative decoding"]


def engine(target, loaded, method: str, budget: int | None) -> Engine:
    if method == "draft":
        return Engine(target, draft=loaded("llama_draft"), method="draft", k=3, adaptive_k=False,
                      max_num_batched_tokens=budget)
    return Engine(target, method=method, k=3, adaptive_k=False, max_num_batched_tokens=budget)


def run(sched: BatchScheduler, prompts: list, params: SamplingParams) -> list[list[int]]:
    outs: dict[int, list[int]] = {}
    seqs = []
    for i, p in enumerate(prompts):
        ids = sched.engine.encode(p, params)
        seqs.append(SeqRequest(ids, params, lambda o, i=i: outs.setdefault(i, []).extend(
            o.chunk.token_ids if o.chunk is not None else [])))
    sched.submit(seqs)
    sched.run_until_idle()
    return [outs.get(i, []) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def target(loaded):
    return loaded("llama_tied")


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
                                    SamplingParams(max_new_tokens=24, temperature=0.9, seed=5, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_chunked_prefill_changes_no_output(target, loaded, method, params):
    prompts = SHORT[:2] + [LONG] + SHORT[2:] + [LONG[:70]]
    whole = run(BatchScheduler(engine(target, loaded, method, None), max_batch=3, calibrate=False), prompts, params)
    chunked = run(BatchScheduler(engine(target, loaded, method, MIN_CHUNK), max_batch=3, calibrate=False),
                  prompts, params)
    assert chunked == whole
    assert all(len(t) == 24 for t in whole)
    alone = Engine(target, method="none", max_num_batched_tokens=MIN_CHUNK)     # a batch of one chunks too
    assert alone.generate(LONG, params).token_ids == whole[2]


def test_a_long_prompt_takes_several_steps_while_the_others_decode(target, loaded):
    budget = MIN_CHUNK
    eng = engine(target, loaded, "none", budget)
    sched = BatchScheduler(eng, max_batch=4, calibrate=False)
    got: dict[str, list] = {"a": [], "b": [], "long": []}
    params = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    for name in ("a", "b"):
        sched.submit([SeqRequest(eng.encode(SHORT[0], params), params,
                                 lambda o, name=name: got[name].append(len(o.chunk.token_ids)))])
    sched.step()
    sched.submit([SeqRequest(LONG, params, lambda o: got["long"].append(len(o.chunk.token_ids)))])
    steps = 0
    while not got["long"]:
        sched.step()
        steps += 1
    # each step leaves the long prompt budget - 2 running rows' tokens (at least MIN_CHUNK)
    per_step = max(budget - 2, min(budget, MIN_CHUNK))
    assert steps == -(-(len(LONG) - 1) // per_step) >= 4
    assert got["a"] == got["b"] == [1] * (steps + 1)       # one token per step for the running rows, no stall
    sched.run_until_idle()


def test_the_budget_is_checked(target):
    with pytest.raises(ConfigError) as e:
        Engine(target, method="none", max_num_batched_tokens=0)
    assert e.value.field == "max_num_batched_tokens"

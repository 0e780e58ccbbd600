"""Logits processors (sampling/processors.py) against transformers' own warpers as the reference (the
`ref_probs` fixture), applied in the order generate applies them: repetition penalty, temperature, top-k,
top-p, min-p."""
from __future__ import annotations

import pytest
import torch

from leaplm.config import SamplingParams
from leaplm.sampling import LogitsProcessor, block_presence, make_generator

V = 50


def presence_of(context: list[list[int]]) -> torch.Tensor:
    pres = torch.zeros(len(context), V, dtype=torch.bool)
    for i, ids in enumerate(context):
        pres[i, ids] = True
    return pres


CASES = [
    dict(),
    dict(temperature=0.7),
    dict(temperature=1.6, top_k=5),
    dict(top_p=0.8),
    dict(temperature=0.5, top_p=0.5),
    dict(min_p=0.1),
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7, temperature=0.9),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    dict(top_k=1),
    dict(top_k=V + 10),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_probs_match_transformers(kw, ref_probs):
    g = torch.Generator().manual_seed(len(kw))
    logits = torch.randn(6, V, generator=g) * 3                                       # [N, V]
    context = [torch.randint(0, V, (n,), generator=g).tolist() for n in (0, 1, 3, 7, 12, 30)]
    sp = SamplingParams(**kw)
    got = LogitsProcessor(sp).probs(logits, presence_of(context) if sp.repetition_penalty != 1.0 else None)
    torch.testing.assert_close(got, ref_probs(logits, context, sp), atol=1e-6, rtol=0)
    assert torch.allclose(got.sum(-1), torch.ones(6))


def test_filters_really_remove_tokens():
    """Control for the comparison above: the truncating processors leave exact zeros where transformers does."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)) * 3
    for kw, kept in ((dict(top_k=5), 5), (dict(top_p=0.5), None), (dict(min_p=0.2), None)):
        p = LogitsProcessor(SamplingParams(**kw)).probs(logits)
        n = int((p > 0).sum())
        assert n < V and (kept is None or n == kept)


def test_greedy_is_the_argmax_of_the_penalised_logits(ref_probs):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    context = [[int(logits[i].argmax())] for i in range(4)]                          # penalise the argmax itself
    sp = SamplingParams(temperature=0, repetition_penalty=5.0)
    proc = LogitsProcessor(sp)
    expect = ref_probs(logits, context, SamplingParams(repetition_penalty=5.0)).argmax(-1)
    assert torch.equal(proc.greedy(logits, presence_of(context)), expect)
    assert not torch.equal(proc.greedy(logits, presence_of(context)), logits.argmax(-1))
    # top-k/top-p/min-p never remove the argmax, so greedy ignores them
    sp2 = SamplingParams(temperature=0.5, top_k=3, top_p=0.3, min_p=0.5)
    assert torch.equal(LogitsProcessor(sp2).probs(logits).argmax(-1), logits.argmax(-1))


def test_block_presence_counts_earlier_drafts():
    base = torch.zeros(6, dtype=torch.bool)
    base[1] = True
    rows = block_presence(base, torch.tensor([3, 4, 3]))                               # [4, 6]
    expect = [[1], [1, 3], [1, 3, 4], [1, 3, 4]]
    for r, ids in zip(rows, expect):
        assert torch.nonzero(r).view(-1).tolist() == ids
    assert base.tolist() == [False, True, False, False, False, False]                  # base untouched


def test_generator_is_seeded():
    p = torch.full((1, V), 1.0 / V)
    a = [int(LogitsProcessor.sample(p, make_generator(7))) for _ in range(3)]
    b = [int(LogitsProcessor.sample(p, make_generator(7))) for _ in range(3)]
    assert a == b
    draws = {int(LogitsProcessor.sample(p, make_generator(s))) for s in range(20)}
    assert len(draws) > 5

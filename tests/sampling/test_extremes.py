"""Sampling parameters at the extremes of their accepted ranges: every value works, probabilities are never NaN,
and a step never raises (torch.multinomial is not in the engine's sampling path; the exponential race is)."""
from __future__ import annotations

import math

import pytest
import torch

from leaplm import Engine, SamplingParams
from leaplm.config import ConfigError
from leaplm.sampling import LogitsProcessor

EXTREMES = [
    dict(temperature=1e-38), dict(temperature=5e-324), dict(temperature=1e-5), dict(temperature=1e-4),
    dict(temperature=100.0), dict(top_p=1e-46), dict(top_p=5e-324), dict(repetition_penalty=1e-45),
    dict(repetition_penalty=5e-324), dict(repetition_penalty=10.0), dict(min_p=5e-324), dict(min_p=1.0),
    dict(top_k=1), dict(temperature=1e-4, top_p=1e-46, min_p=1.0, repetition_penalty=1e-45, top_k=1),
]


def logits_and_presence(seed: int = 0, n: int = 3, V: int = 50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 8                                       # [n, V]
    presence = torch.rand(n, V, generator=g) < 0.3                                    # [n, V]
    return logits, presence


@pytest.mark.parametrize("extra", EXTREMES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_probs_are_a_distribution_at_the_extremes(extra):
    params = SamplingParams(**extra)
    proc = LogitsProcessor(params)
    logits, presence = logits_and_presence()
    if params.greedy:
        assert proc.greedy(logits, presence).shape == (3,)
        return
    p = proc.probs(logits, presence)
    assert torch.isfinite(p).all() and (p >= 0).all()
    assert torch.allclose(p.double().sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-5)


def test_a_temperature_below_the_threshold_is_greedy():
    assert SamplingParams(temperature=SamplingParams.GREEDY_BELOW / 2).greedy
    assert not SamplingParams(temperature=SamplingParams.GREEDY_BELOW).greedy


def test_tiny_top_p_keeps_only_the_top_token():
    logits, _ = logits_and_presence()
    p = LogitsProcessor(SamplingParams(top_p=1e-46)).probs(logits)
    assert torch.equal(p.argmax(-1), logits.argmax(-1)) and torch.equal(p.max(-1).values, torch.ones(3))


@pytest.mark.parametrize("r", [1e-45, 1e-200, 1e-310, 5e-324])
def test_a_tiny_repetition_penalty_is_exact_where_it_overflows(r):
    """Reference: the same formula in exact rational arithmetic terms: with l / r for seen positive logits, the
    distribution at temperature 1 is softmax((l - l_max) / r) over those tokens when any exists."""
    logits, presence = logits_and_presence(1)
    p = LogitsProcessor(SamplingParams(repetition_penalty=r)).probs(logits, presence)
    for i in range(3):
        boosted = presence[i] & (logits[i] > 0)
        assert boosted.any()
        l = logits[i].double()
        lm = float(l[boosted].max())
        want = torch.zeros_like(l)
        want[boosted] = torch.exp((l[boosted] - lm) / r)    # (l - lm) / r: no overflow; the max term is exp(0)
        want /= want.sum()
        assert torch.allclose(p[i].double(), want, atol=1e-6)
        assert not math.isnan(float(p[i].sum()))


@pytest.fixture(scope="module")
def engines(loaded):
    target = loaded("llama_tied")
    return {"none": Engine(target, method="none"),
            "draft": Engine(target, draft=target, method="draft", k=4, adaptive_k=False),
            "ngram": Engine(target, method="ngram", k=3, adaptive_k=False),
            "lookahead": Engine(target, method="lookahead", k=4, adaptive_k=False)}


@pytest.mark.parametrize("extra", EXTREMES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_generation_runs_at_the_extremes(extra, engines):
    outs = {}
    for name, eng in engines.items():
        out = eng.generate("the quick brown fox", SamplingParams(max_new_tokens=12, seed=3, ignore_eos=True, **extra))
        assert len(out.token_ids) == 12 and out.finish_reason == "length", name
        outs[name] = out.token_ids
    assert len({tuple(v) for v in outs.values()}) == 1, outs     # seeded: every method gives the same tokens


def test_a_tiny_temperature_generates_the_greedy_text(engines):
    greedy = engines["none"].generate("the quick brown fox", SamplingParams(max_new_tokens=12, temperature=0))
    tiny = engines["draft"].generate("the quick brown fox", SamplingParams(max_new_tokens=12, temperature=1e-38))
    assert tiny.token_ids == greedy.token_ids


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("temperature", -1e-300), ("top_p", 0.0), ("top_p", float("nan")),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")),
                                         ("min_p", float("nan")), ("min_p", -5e-324)])
def test_values_outside_the_range_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field

"""EAGLE and Medusa heads on a quantized target (--quantization frees the fp LM head and computes with the
quantized one): they draft through the target's head as it computes, and greedy output equals plain decoding of
the same quantized model."""
from __future__ import annotations

import pytest

from head_helpers import train_tiny_eagle, write_word_corpus
from leaplm import Engine, SamplingParams
from leaplm.models import load_model


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_heads_on_an_int8_target_equal_none(tiny_llama_factory, tmp_path, kind):
    fp = tiny_llama_factory(vocab=16, layers=2, seed=3)
    extra = {"medusa_heads": 2} if kind == "medusa" else {}
    train_tiny_eagle(fp.path, write_word_corpus(tmp_path / "c.jsonl", 16), tmp_path / "head", steps=10,
                     kind=kind, **extra)
    target = load_model(fp.path, quantization="int8")
    assert target.model.lm_head.weight.numel() == 0            # the fp head is gone: only the quantized one runs
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    eng = Engine(target, method=kind, k=3, head=str(tmp_path / "head"), adaptive_k=False)
    for prompt in ([1, 2, 3], [7, 3, 9, 3, 7]):
        out = eng.generate(prompt, params)
        assert out.token_ids == Engine(target, method="none").generate(prompt, params).token_ids
        assert out.stats.draft_tokens > 0

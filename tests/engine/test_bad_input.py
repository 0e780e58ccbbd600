"""Bad input fails early with a ConfigError naming the field, before any model runs."""
from __future__ import annotations

import json
import shutil

import pytest

from leaplm.config import ConfigError, SamplingParams, SpecConfig
from leaplm.engine.engine import Engine
from leaplm.models import load_model


def raises_field(field: str, *words: str):
    """Context manager: a ConfigError whose field is `field` and whose message contains `words`."""
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(ConfigError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.ctx.__exit__(*exc)
            err = self.info.value
            assert err.field == field, f"field {err.field!r}, expected {field!r}: {err}"
            assert str(err).startswith(f"{field}: ")
            for w in words:
                assert w in str(err), f"{w!r} not in {str(err)!r}"
            return suppressed

    return _Check()


@pytest.fixture(scope="module")
def engine(loaded):
    return Engine(loaded("llama_tied"), method="none")


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(prompt, engine):
    with raises_field("prompt", "empty"):
        engine.generate(prompt, SamplingParams(max_new_tokens=4))
    with raises_field("prompt", "empty"):
        engine.stream(prompt, SamplingParams(max_new_tokens=4))


def test_prompt_token_ids_out_of_range(engine):
    with raises_field("prompt", "320"):
        engine.generate([1, 2, 320], SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize("k", [0, -1, 65, 2.0, True])
def test_k_below_one_or_not_an_integer(k, loaded):
    with raises_field("k"):
        Engine(loaded("llama_tied"), draft=loaded("llama_draft"), method="draft", k=k)
    with raises_field("k"):
        SpecConfig(method="none", k=k)


@pytest.mark.parametrize("t", [-0.1, -1, float("nan"), float("inf"), "0.5"])
def test_temperature(t):
    with raises_field("temperature"):
        SamplingParams(temperature=t)


@pytest.mark.parametrize("top_p", [0, 0.0, -0.5, 1.01, 2])
def test_top_p_outside_open_closed_unit_interval(top_p):
    with raises_field("top_p", "(0, 1]"):
        SamplingParams(top_p=top_p)


@pytest.mark.parametrize("m", [0, -1, 1.5, None])
def test_max_new_tokens_below_one(m):
    with raises_field("max_new_tokens"):
        SamplingParams(max_new_tokens=m)


def test_limits_that_are_valid_pass():
    """Control: the edges of every range above are accepted."""
    SamplingParams(temperature=0, top_p=1.0, max_new_tokens=1)
    SamplingParams(top_p=1e-6, temperature=100.0)
    SpecConfig(method="none", k=1)


def test_max_new_tokens_beyond_the_context(engine):
    with raises_field("max_new_tokens", "256"):
        engine.generate("the quick brown fox", SamplingParams(max_new_tokens=256))


def test_draft_vocab_differs_names_both_sizes(loaded, tiny_vocab):
    with raises_field("draft", "8", "320"):
        Engine(loaded("llama_tied"), draft=tiny_vocab["far"], method="draft")


def test_draft_tokenizer_differs_at_equal_size(loaded, tiny_llama_factory):
    """Same vocabulary size, different tokens: the draft's token ids would mean other words."""
    words = tiny_llama_factory(vocab=320, layers=1)                 # t0..t319, not the byte-level BPE
    with raises_field("draft", "tokenizer"):
        Engine(loaded("llama_tied"), draft=words, method="draft")


def test_model_path_that_does_not_exist(tmp_path, loaded):
    missing = str(tmp_path / "no" / "such" / "model")
    with raises_field("model", missing):
        load_model(missing)
    with raises_field("model", "does not exist"):
        Engine(missing, method="none")
    with raises_field("draft", missing):
        Engine(loaded("llama_tied"), draft=missing, method="draft")


def test_directory_without_config(tmp_path):
    with raises_field("model", "config.json"):
        load_model(str(tmp_path))


def test_unknown_method(loaded):
    with raises_field("method", "bogus", "none"):
        Engine(loaded("llama_tied"), method="bogus")


def test_method_draft_without_a_draft(loaded):
    with raises_field("draft"):
        Engine(loaded("llama_tied"), method="draft")


def test_unsupported_architecture_bert(bert_dir, loaded):
    """An encoder-only checkpoint: transformers would wrap it in BertLMHeadModel with a random head."""
    with raises_field("model", "bert", "architecture"):
        load_model(bert_dir)
    with raises_field("draft", "bert"):
        Engine(loaded("llama_tied"), draft=bert_dir, method="draft")


def test_unsupported_architecture_without_architectures_field(bert_dir, tmp_path):
    """Without config.architectures to go by, the weights transformers had to invent give it away."""
    d = tmp_path / "bert"
    shutil.copytree(bert_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["architectures"]
    (d / "config.json").write_text(json.dumps(cfg))
    with raises_field("model", "bert", "missing"):
        load_model(str(d))


def test_bad_dtype(checkpoint):
    with raises_field("dtype", "float32"):
        load_model(checkpoint("llama_tied"), dtype="float64")


def test_unsupported_architecture_masked_lm(byte_tokenizer, tmp_path):
    """A masked LM has every weight transformers' BertLMHeadModel wants, but attends both ways: only its
    declared architecture tells it apart from a causal LM."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=len(byte_tokenizer), hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=4, intermediate_size=64)).save_pretrained(str(tmp_path))
    byte_tokenizer.save_pretrained(str(tmp_path))
    with raises_field("model", "BertForMaskedLM", "causal-LM head"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("field,value", [
    ("top_k", -1), ("top_k", 2.5), ("min_p", 1.5), ("min_p", -0.1), ("repetition_penalty", 0),
    ("repetition_penalty", float("nan")), ("seed", 1.5), ("stop", 5), ("stop", [""]), ("stop_token_ids", 5),
    ("stop_token_ids", [-1]), ("logprobs", 21), ("logprobs", True), ("verifier", "exact"), ("verifier", None),
])
def test_other_sampling_fields(field, value):
    with raises_field(field):
        SamplingParams(**{field: value})

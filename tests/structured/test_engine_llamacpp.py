"""Structured output on the libllama backend: the grammar masks the logits whatever computed them, so greedy
output under a constraint is token-identical across methods and plain decoding there as on torch (a tiny random
Llama exported to GGUF Q8_0). Skips only when the llamacpp extra is not installed (CI installs it)."""
from __future__ import annotations

import json

import pytest

from leaplm import Engine, SamplingParams, StructuredOutput
from leaplm.models.llamacpp.binding import available
from letters import _root_conftest

pytestmark = pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["word", "n"], "additionalProperties": False}
CONSTRAINTS = [StructuredOutput(json=SCHEMA), StructuredOutput(regex="(the|fox|dog)( (the|fox|dog)){2,6}"),
               StructuredOutput(choice=["quick brown", "lazy dog"])]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from leaplm.models.gguf_export import export_gguf

    root = _root_conftest()
    d = tmp_path_factory.mktemp("structured_gguf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # transformers' GGUF tokenizer for a gpt2-type vocabulary expects this end-of-text token
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(root.BPE_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    target = root.write_family_checkpoint(d / "target", "llama_tied", fast)
    return str(export_gguf(target, str(d / "target-q8_0.gguf"), "q8_0").path)


@pytest.mark.parametrize("method, opts", [("ngram", dict(k=4)), ("suffix", dict(k=6)),
                                          ("lookahead", dict(k=4, window=2, ngram_size=2))])
def test_greedy_under_a_constraint_equals_none_on_libllama(gguf, method, opts):
    plain = Engine(gguf, method="none", backend="llamacpp")
    eng = Engine(gguf, method=method, backend="llamacpp", adaptive_k=False, **opts)
    assert eng.backend == "llamacpp"
    for spec in CONSTRAINTS:
        params = SamplingParams(temperature=0, max_new_tokens=48, structured=spec)
        ref = plain.generate("the quick brown fox", params)
        out = eng.generate("the quick brown fox", params)
        assert out.token_ids == ref.token_ids, (method, spec.kind)
        if spec.kind == "json" and ref.finish_reason == "stop":
            json.loads(ref.text)

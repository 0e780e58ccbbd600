"""A draft whose vocabulary is padded past the tokenizer's (Qwen2.5 0.5B vs 7B: 151936 vs 152064 rows) is accepted
when the tokenizers agree on every token: its padded rows are masked, so it never proposes them, and the output
is the target's. A draft whose tokenizer disagrees is refused naming the field and a token."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import load_model

PAD = 64


@pytest.fixture(scope="module")
def padded_draft(checkpoint, byte_tokenizer, tmp_path_factory):
    """The target itself (llama_tied) with PAD extra embedding/lm_head rows whose logits dwarf every real token's:
    a draft that did not mask them would propose padding every time; masked, it proposes what the target says."""
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("padded_draft")
    shutil.copytree(checkpoint("llama_tied"), d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    V = cfg["vocab_size"]
    cfg["vocab_size"] = V + PAD
    cfg["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(d / "model.safetensors"))
    hidden = sd["model.embed_tokens.weight"].shape[1]
    sd["model.embed_tokens.weight"] = torch.cat([sd["model.embed_tokens.weight"], torch.zeros(PAD, hidden)])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"][:V])
    sd["lm_head.weight"] = torch.cat([head, 50 * torch.ones(PAD, hidden)])
    save_file(sd, str(d / "model.safetensors"))
    assert len(byte_tokenizer) == V
    return str(d)


def test_padded_draft_is_accepted_and_lossless(loaded, padded_draft):
    target = loaded("llama_tied")
    draft = load_model(padded_draft, field="draft")
    assert draft.model.vocab_size == target.model.vocab_size + PAD
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    ref = Engine(target, method="none").generate("the quick brown fox", params).token_ids
    eng = Engine(target, draft=draft, method="draft", k=3, adaptive_k=False)
    out = eng.generate("the quick brown fox", params)
    assert out.token_ids == ref
    assert out.stats.accepted_tokens == out.stats.draft_tokens > 0        # the target's own tokens, never padding
    sampled = eng.generate("the quick brown fox", SamplingParams(temperature=0.8, seed=1, max_new_tokens=16,
                                                                 ignore_eos=True))
    assert all(t < target.model.vocab_size for t in sampled.token_ids)


def test_draft_with_a_disagreeing_tokenizer_is_refused(loaded, checkpoint, tmp_path):
    d = tmp_path / "swapped"
    shutil.copytree(checkpoint("llama_draft"), d)
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]                       # same size, two ids swapped
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ConfigError) as e:
        Engine(loaded("llama_tied"), draft=str(d), method="draft")
    assert e.value.field == "draft" and "disagrees" in e.value.message
    assert repr(a) in e.value.message or repr(b) in e.value.message

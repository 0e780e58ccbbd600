"""Native families and the transformers fallback against transformers itself (fp32, tiny random checkpoints).

Logits must agree within 1e-4 through every path the engine uses (a prefill, a verification block, single
decoding steps over the cache), and 64-token greedy continuations must be identical to `generate`.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine

NATIVE = ["llama_tied", "llama3_rope", "llama_linear", "mistral_sw", "qwen2_bias", "qwen3_qknorm"]
ATOL = 1e-4
PROMPT = "the quick brown fox jumps over the lazy dog; un café crème 🙂 speculative decoding drafts tokens"


def hf_model(path: str, **overrides):
    return AutoModelForCausalLM.from_pretrained(path, **overrides).eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None          # run the full n tokens, as ignore_eos does
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=0,
                         pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def prompt_ids(tokenizer, repeat: int = 2) -> list[int]:
    return tokenizer(PROMPT, add_special_tokens=False)["input_ids"] * repeat


@pytest.mark.parametrize("name", NATIVE)
def test_native_loader_picks_the_feature_under_test(name, loaded):
    """The checkpoint really exercises what its name says (otherwise the parity below proves less)."""
    lm = loaded(name)
    a = lm.model.args
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    assert a.num_key_value_heads < a.num_attention_heads                              # GQA
    tied = lm.model.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
    assert tied == (name in ("llama_tied", "llama_linear", "qwen2_bias"))
    assert (a.rope_scaling or {}).get("rope_type") == {"llama3_rope": "llama3", "llama_linear": "linear"}.get(name)
    assert a.sliding_window == (8 if name == "mistral_sw" else None)
    assert a.attention_bias == (name == "qwen2_bias")
    assert a.qk_norm == (name == "qwen3_qknorm")


@pytest.mark.parametrize("name", NATIVE)
def test_logits_match_transformers(name, checkpoint, loaded):
    lm = loaded(name)
    ids = torch.tensor([prompt_ids(lm.tokenizer)])                                  # [1, T], T > sliding window
    T = ids.shape[1]
    with torch.no_grad():
        ref = hf_model(checkpoint(name))(ids).logits[0]                              # [T, V]
    # one prefill
    cache = lm.model.new_cache(1, 256)
    full = lm.model(ids, cache)[0]                                                  # [T, V]
    torch.testing.assert_close(full, ref, atol=ATOL, rtol=0)
    # the engine's way: prefill, a verification block of 6, then single tokens, each over the cache
    cache = lm.model.new_cache(1, 256)
    split = T - 12
    parts = [lm.model(ids[:, :split], cache)[0]]
    cache.advance(split)
    parts.append(lm.model(ids[:, split : split + 6], cache)[0])
    cache.advance(6)
    for t in range(split + 6, T):
        parts.append(lm.model(ids[:, t : t + 1], cache)[0])
        cache.advance(1)
    torch.testing.assert_close(torch.cat(parts), ref, atol=ATOL, rtol=0)
    # last_only returns the last row of the same computation
    cache = lm.model.new_cache(1, 256)
    torch.testing.assert_close(lm.model(ids, cache, last_only=True)[0, 0], ref[-1], atol=ATOL, rtol=0)
    # hidden_all (a prefill feeding an EAGLE head): every position's hidden state, the last position's logits
    whole = lm.model.forward_hidden(ids, lm.model.new_cache(1, 256))
    part = lm.model.forward_hidden(ids, lm.model.new_cache(1, 256), last_only=True, hidden_all=True)
    assert part.logits.shape == (1, 1, ref.shape[-1]) and part.hidden.shape == whole.hidden.shape
    torch.testing.assert_close(part.hidden, whole.hidden, atol=0, rtol=0)
    torch.testing.assert_close(part.logits[0, 0], ref[-1], atol=ATOL, rtol=0)


def test_sliding_window_and_rope_scaling_change_the_logits(checkpoint):
    """Control for the parity test: turning the feature off in transformers moves the logits by far more than
    ATOL, so matching with it on means leaplm implements it."""
    ids = torch.arange(1, 41).view(1, -1)                                             # 40 tokens > window of 8
    with torch.no_grad():
        on = hf_model(checkpoint("mistral_sw"))(ids).logits
        off = hf_model(checkpoint("mistral_sw"), sliding_window=None)(ids).logits
        assert (on - off).abs().max() > 100 * ATOL
        scaled = hf_model(checkpoint("llama3_rope"))(ids).logits
        plain = hf_model(checkpoint("llama3_rope"), rope_parameters={"rope_type": "default",
                                                                     "rope_theta": 10000.0})(ids).logits
        assert (scaled - plain).abs().max() > 100 * ATOL


@pytest.mark.parametrize("name", NATIVE)
def test_greedy_continuation_matches_generate(name, checkpoint, loaded):
    lm = loaded(name)
    ids = prompt_ids(lm.tokenizer, repeat=1)
    ref = hf_greedy(hf_model(checkpoint(name)), ids, 64)
    out = Engine(lm, method="none").generate(ids, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
    assert len(ref) == 64
    assert out.token_ids == ref


# --- the transformers fallback adapter (models/hf.py) -----------------------------------------------------------
def test_fallback_logits_match_transformers(checkpoint, loaded):
    lm = loaded("gpt2")
    assert type(lm.model).__name__ == "HFCausalLM"
    ids = torch.tensor([prompt_ids(lm.tokenizer)])
    with torch.no_grad():
        ref = hf_model(checkpoint("gpt2"))(ids).logits[0]
    cache = lm.model.new_cache()
    torch.testing.assert_close(lm.model(ids, cache)[0], ref, atol=ATOL, rtol=0)


def test_fallback_greedy_matches_generate(checkpoint, loaded):
    lm = loaded("gpt2")
    ids = prompt_ids(lm.tokenizer, repeat=1)
    ref = hf_greedy(hf_model(checkpoint("gpt2")), ids, 64)
    out = Engine(lm, method="none").generate(ids, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
    assert out.token_ids == ref


@pytest.mark.parametrize("draft", ["gpt2", "gpt2_draft"])
def test_fallback_draft_method_equals_none(draft, loaded):
    """Speculation over the fallback's DynamicCache (rolled back by cropping) is token-identical to plain decoding."""
    lm = loaded("gpt2")
    ids = prompt_ids(lm.tokenizer, repeat=1)
    params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    ref = Engine(lm, method="none").generate(ids, params).token_ids
    out = Engine(lm, draft=loaded(draft), method="draft", k=4, adaptive_k=False).generate(ids, params)
    assert out.token_ids == ref
    assert out.stats.draft_tokens > 0
    if draft == "gpt2_draft":                                # rejections happened, so the cache was cropped
        assert out.stats.accepted_tokens < out.stats.draft_tokens

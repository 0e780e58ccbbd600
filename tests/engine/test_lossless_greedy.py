"""At temperature 0, speculation is token-identical to plain decoding (method 'none'), whatever the draft
agrees with, whatever K, with the adaptive K controller on (K may drop to 0 and come back) or off."""
from __future__ import annotations

import pytest

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine

PROMPTS = ["the quick brown fox", "un café crème 🙂 def add(a, b):"]
NEW = 40


@pytest.fixture(scope="module")
def reference(loaded):
    """Plain greedy decoding per (target, prompt, repetition penalty)."""
    memo = {}

    def get(target: str, prompt: str, penalty: float = 1.0) -> list[int]:
        key = (target, prompt, penalty)
        if key not in memo:
            params = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, repetition_penalty=penalty)
            memo[key] = Engine(loaded(target), method="none").generate(prompt, params).token_ids
        return memo[key]

    return get


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_k", "adaptive_k"])
@pytest.mark.parametrize("draft", ["self", "other"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_greedy_equals_none(k, draft, adaptive, loaded, reference):
    """draft 'self' is the target (agrees almost always: long accepted blocks and bonus tokens); 'other' is an
    unrelated random model (rejections nearly every step, so every step rolls both caches back)."""
    target = loaded("llama_tied")
    eng = Engine(target, draft=target if draft == "self" else loaded("llama_draft"), method="draft", k=k,
                 adaptive_k=adaptive)
    drafted = accepted = 0
    for prompt in PROMPTS:
        out = eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
        assert out.token_ids == reference("llama_tied", prompt)
        assert out.finish_reason == "length"
        drafted += out.stats.draft_tokens
        accepted += out.stats.accepted_tokens
    if not adaptive:                                 # the regime the test claims to cover really happened
        assert drafted > 0
        assert accepted / drafted > 0.9 if draft == "self" else accepted / drafted < 0.5


@pytest.mark.parametrize("target", ["mistral_sw", "qwen3_qknorm"])
def test_other_families_under_speculation(target, loaded, reference):
    """A sliding window (8) far shorter than the sequence, and q/k norms, verified in blocks of K + 1."""
    for draft in (loaded(target), loaded("llama_draft")):
        eng = Engine(loaded(target), draft=draft, method="draft", k=5, adaptive_k=False)
        for prompt in PROMPTS:
            out = eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
            assert out.token_ids == reference(target, prompt)


@pytest.mark.parametrize("draft", ["self", "other"])
def test_repetition_penalty_counts_earlier_drafts(draft, loaded, reference):
    """Greedy with a repetition penalty: row i of a verified block must count drafts 1..i-1 as context."""
    target = loaded("llama_tied")
    eng = Engine(target, draft=target if draft == "self" else loaded("llama_draft"), method="draft", k=4,
                 adaptive_k=False)
    for prompt in PROMPTS:
        params = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True, repetition_penalty=1.8)
        out = eng.generate(prompt, params)
        assert out.token_ids == reference("llama_tied", prompt, 1.8)
    assert reference("llama_tied", PROMPTS[0], 1.8) != reference("llama_tied", PROMPTS[0])   # the penalty acts


def test_engine_is_reusable_across_requests(loaded, reference):
    """One engine, requests of different lengths back to back: no state leaks between them."""
    target = loaded("llama_tied")
    eng = Engine(target, draft=loaded("llama_draft"), method="draft", k=3, adaptive_k=False)
    for prompt in PROMPTS + PROMPTS[::-1]:
        out = eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
        assert out.token_ids == reference("llama_tied", prompt)


def test_draft_with_a_shorter_context(loaded, reference):
    """A draft with 48 positions under a 256-position target: the engine's context is the shorter one, so a
    request that fits runs (and is lossless) and one that does not is refused up front, not mid-generation."""
    from leaplm.config import ConfigError

    eng = Engine(loaded("llama_tied"), draft=loaded("llama_draft_short"), method="draft", k=4, adaptive_k=False)
    assert eng.max_model_len == 48
    prompt = PROMPTS[0]
    n_prompt = len(loaded("llama_tied").tokenizer(prompt, add_special_tokens=False)["input_ids"])
    out = eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=48 - n_prompt, ignore_eos=True))
    assert out.token_ids == reference("llama_tied", prompt)[: 48 - n_prompt]
    with pytest.raises(ConfigError) as e:
        eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=49 - n_prompt))
    assert e.value.field == "max_new_tokens"


@pytest.mark.parametrize("prompt_len", [1, 2, 27])
def test_context_filled_exactly(prompt_len, loaded):
    """prompt + max_new_tokens == the context: K shrinks to the room left instead of overrunning the cache; a
    one-token prompt has nothing to prefill."""
    target = loaded("mistral_sw")
    prompt = list(range(3, 3 + prompt_len))
    params = SamplingParams(temperature=0, max_new_tokens=40 - prompt_len, ignore_eos=True)
    ref = Engine(target, method="none", max_model_len=40).generate(prompt, params).token_ids
    for draft in (target, loaded("llama_draft")):
        out = Engine(target, draft=draft, method="draft", k=8, adaptive_k=False, max_model_len=40).generate(prompt, params)
        assert out.token_ids == ref and len(ref) == 40 - prompt_len


def test_greedy_draws_no_random_numbers(loaded):
    """Greedy requests carry no generator and leave the global RNG alone."""
    import torch

    target = loaded("llama_tied")
    eng = Engine(target, draft=loaded("llama_draft"), method="draft", k=3, adaptive_k=False)
    before = torch.get_rng_state()
    eng.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True))
    assert torch.equal(before, torch.get_rng_state())

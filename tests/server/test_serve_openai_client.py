"""The official openai client against a real `leaplm serve` process."""
from __future__ import annotations

import httpx
import pytest

from leaplm import SamplingParams

from serverkit import API_KEY, MODEL

PROMPTS = ["the quick brown fox", "déjà vu", "def add(a, b):", "東京 と", "speculative decoding drafts"]


def spec_usage(usage) -> dict:
    return usage.model_extra["speculative"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_generate_method_none(client, reference, prompt):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    ref = reference.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0))
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_ids)
    s = spec_usage(r.usage)
    assert s["method"] == "draft" and s["k"] == 4
    assert s["target_forwards"] >= 1
    assert s["mean_accepted_length"] == pytest.approx(r.usage.completion_tokens / s["target_forwards"])


def test_greedy_chat_uses_the_chat_template(client, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello, how are you?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|system|>be brief\n<|user|>")
    ref = reference.generate(text, SamplingParams(max_new_tokens=30, temperature=0))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_ids)


def test_chat_default_max_tokens_is_the_rest_of_the_context(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       extra_body={"ignore_eos": True, "speculative": {"method": "none"}})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 1024


def test_streaming_with_usage(client, reference):
    prompt = "über Straße, 東京"
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].text for c in chunks[:-1])
    ref = reference.generate(prompt, SamplingParams(max_new_tokens=48, temperature=0))
    assert text == ref.text
    finish = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finish[-1] == ref.finish_reason and all(f is None for f in finish[:-1])
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert "speculative" in chunks[-1].usage.model_extra


def test_chat_streaming(client, reference):
    messages = [{"role": "user", "content": "tell me about 🙂 🚀"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == reference.generate(prompt, SamplingParams(max_new_tokens=32, temperature=0)).text
    assert chunks[-1].usage.completion_tokens > 0


def test_streamed_text_never_holds_half_a_character(client):
    """Random tiny models emit bytes that are not UTF-8 on their own: every streamed piece must still be text that
    the complete output starts with, piece by piece (nothing emitted is later taken back)."""
    for prompt in PROMPTS:
        pieces = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stream=True) if c.choices]
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0).choices[0].text
        assert "".join(pieces) == full
        assert all(p.encode("utf-8").decode("utf-8") == p for p in pieces)


def test_stop_string_is_not_leaked_into_the_stream(client, reference):
    prompt = "the quick brown fox"
    ref = reference.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0))
    stop = ref.text[10:13]                # three characters from the middle of the greedy output
    assert len(stop) == 3
    cut = ref.text[: ref.text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                      stream=stream)
        if stream:
            pieces = [c.choices[0].text for c in r]
            text = "".join(pieces)
            assert all(stop[:2] not in "".join(pieces[: i + 1])[len(cut):] for i in range(len(pieces)))
        else:
            text = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
        assert text == cut


def test_logprobs_are_the_targets(client, reference):
    import torch

    prompt = "speculative decoding"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ref = reference.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, logprobs=3))
    assert len(lp.token_logprobs) == len(ref.logprobs) == r.usage.completion_tokens
    for got, want in zip(lp.token_logprobs, ref.logprobs):
        assert got == pytest.approx(want.logprob, abs=1e-4)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)    # a dict: tokens that decode alike share a key
    assert "".join(lp.tokens) == r.choices[0].text or "\ufffd" in "".join(lp.tokens)
    # greedy: the chosen token is the most likely one, so its logprob is the max of the alternatives
    for got, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(max(top.values()), abs=1e-5)
    # independent check of the first position against a plain forward of the target
    ids = reference.encode(prompt, SamplingParams())
    cache = reference.model.new_cache(1, 64)
    logits = reference.model(torch.tensor([ids]), cache)[0, -1]
    assert lp.token_logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1).max()), abs=1e-4)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 and isinstance(c.bytes, list) for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == r.choices[0].message.content


def test_echo_with_prompt_logprobs(client):
    prompt = "the quick brown"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert lp.token_logprobs[0] is None
    assert len(lp.token_logprobs) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0


def test_n_choices_and_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt="un café", max_tokens=24, temperature=0.9, n=3, seed=1234,
              extra_body={"speculative": {"method": "draft", "adaptive_k": False}})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1          # seeds 1234, 1235, 1236 differ
    s = spec_usage(a.usage)
    assert s["draft_tokens"] > 0 and 0 <= s["acceptance_rate"] <= 1   # adaptive_k false: drafts every step
    c = client.completions.create(**{**kw, "seed": 99})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_seeded_chat_is_reproducible_under_speculation(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=30, temperature=1.0,
              top_p=0.95, seed=7)
    outs = {client.chat.completions.create(**kw).choices[0].message.content for _ in range(3)}
    assert len(outs) == 1


def test_speculative_extension(client, reference):
    prompt = "the lazy dog"
    ref = reference.generate(prompt, SamplingParams(max_new_tokens=30, temperature=0))
    off = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                    extra_body={"speculative": {"method": "none"}})
    s = spec_usage(off.usage)
    assert s["method"] == "none" and s["draft_tokens"] == 0 and s["mean_accepted_length"] == 1.0
    assert off.choices[0].text == ref.text
    on = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.7, seed=3,
                                   extra_body={"speculative": {"method": "draft", "k": 2, "adaptive_k": False}})
    s = spec_usage(on.usage)
    assert s["method"] == "draft" and s["k"] == 2 and s["draft_tokens"] > 0
    assert s["draft_tokens"] <= 2 * s["target_forwards"]
    assert s["accepted_tokens"] <= s["draft_tokens"]


def test_max_tokens_holds_exactly_when_blocks_are_accepted(client):
    for n in (1, 2, 3, 5, 7):
        r = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=n, temperature=0.5,
                                      seed=n, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"


def test_batch_of_prompts(client, reference):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=10, temperature=0, n=2)
    assert len(r.choices) == 6
    for i, c in enumerate(r.choices):
        ref = reference.generate(PROMPTS[i // 2], SamplingParams(max_new_tokens=10, temperature=0))
        assert c.text == ref.text


def test_token_id_prompt(client, reference):
    ids = reference.encode("the quick brown", SamplingParams())
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == reference.generate(ids, SamplingParams(max_new_tokens=10, temperature=0)).text


def test_models_health_metrics_openapi(server, client):
    client.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=0.5, seed=1)  # seeded: drafts
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text          # open without the key (documented policy)
    for name in ("leaplm_requests_total", "leaplm_queue_depth", "leaplm_running_requests",
                 "leaplm_time_to_first_token_seconds_bucket", "leaplm_inter_token_latency_seconds_bucket",
                 "leaplm_e2e_request_latency_seconds_bucket", "leaplm_prompt_tokens_total",
                 "leaplm_generation_tokens_total", "leaplm_spec_decode_num_drafts_total",
                 "leaplm_spec_decode_num_draft_tokens_total", "leaplm_spec_decode_num_accepted_tokens_total",
                 "leaplm_spec_decode_num_accepted_tokens_per_pos_total", "leaplm_spec_decode_k"):
        assert name in text, name
    assert server.metric("leaplm_spec_decode_num_draft_tokens_total") > 0
    assert 'leaplm_requests_total{endpoint="/v1/completions",status="200"}' in text
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(spec["paths"])
    assert API_KEY not in httpx.get(server.url + "/openapi.json").text

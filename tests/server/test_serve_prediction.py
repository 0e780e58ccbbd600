"""Predicted Outputs through `leaplm serve` and the official openai client: the output is the same with and without
a prediction (greedy; seeded samples, n > 1; with logprobs and stop strings; streamed or not, on both endpoints),
usage.completion_tokens_details counts accepted and rejected prediction tokens (in the final streamed usage chunk
too) and /metrics sums them."""
from __future__ import annotations

import pytest

from leaplm import SamplingParams

from serverkit import MODEL

PROMPT = "the target verifies"


def details(usage) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


def pred(text: str) -> dict:
    return {"type": "content", "content": text}


@pytest.fixture(scope="module")
def expected(reference):
    """The longest start of the reference output whose text tokenizes back to its tokens (the random tiny models
    emit bytes that are not UTF-8, which no text prediction can spell)."""
    ids = reference.generate(PROMPT, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)).token_ids
    tok = reference.tokenizer
    j = max(j for j in range(len(ids) + 1) if tok(tok.decode(ids[:j]), add_special_tokens=False)["input_ids"] == ids[:j])
    assert j >= 10
    return tok.decode(ids[:j]), j


def test_chat_with_a_prediction_equals_without(client, reference):
    messages = [{"role": "user", "content": "repeat: speculative decoding drafts tokens"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                           extra_body={"ignore_eos": True})
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is not None and details(plain.usage) == (0, 0)
    for p in (text, text[:10] + "an inserted clause" + text[10:], [{"type": "text", "text": text[:7]},
                                                                   {"type": "text", "text": text[7:]}]):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                           prediction={"type": "content", "content": p},
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == text
        accepted, rejected = details(r.usage)
        assert 0 < accepted + rejected <= r.usage.model_extra["speculative"]["draft_tokens"]


def test_completions_prediction_drafts_long_blocks(client, reference, expected):
    text, n = expected
    full = reference.generate(PROMPT, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)).text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True, "prediction": pred(text),
                                              "speculative": {"method": "none", "adaptive_k": False}})
    assert r.choices[0].text == full
    accepted, rejected = details(r.usage)
    assert accepted >= n - 2
    assert r.usage.model_extra["speculative"]["target_forwards"] <= 40 - accepted + 3


def test_seeded_samples_n2_logprobs_and_stop(client, expected):
    """Seeded sampling is a function of the seed alone: the same choices with and without a prediction."""
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0.8, seed=7, n=2, logprobs=2,
                  stop=["dog"])
    plain = client.completions.create(**common)
    # fixed K: the prediction is drafted at every step, whatever the server's K policy has learnt from other tests
    got = client.completions.create(**common, extra_body={"prediction": pred(plain.choices[0].text + expected[0]),
                                                          "speculative": {"method": "none", "adaptive_k": False}})
    assert [c.text for c in got.choices] == [c.text for c in plain.choices]
    assert [c.finish_reason for c in got.choices] == [c.finish_reason for c in plain.choices]
    for a, b in zip(got.choices, plain.choices):
        assert a.logprobs.tokens == b.logprobs.tokens
        assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=1e-4)
    assert sum(details(got.usage)) > 0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_final_usage_counts_the_prediction(client, chat, expected):
    opts = dict(model=MODEL, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True},
                prediction=pred(expected[0]), extra_body={"ignore_eos": True})
    if chat:
        plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        opts["prediction"] = pred(plain.choices[0].message.content)
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **opts))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == plain.choices[0].message.content
    else:
        opts.pop("prediction")
        opts["extra_body"]["prediction"] = pred(expected[0])
        chunks = list(client.completions.create(prompt=PROMPT, **opts))
        assert "".join(c.choices[0].text for c in chunks if c.choices).startswith(expected[0])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert sum(details(last.usage)) > 0


def test_metrics_sum_the_prediction_counts(client, server, expected):
    before = (server.metric("leaplm_accepted_prediction_tokens_total"),
              server.metric("leaplm_rejected_prediction_tokens_total"))
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True, "prediction": pred(expected[0] + " and more")})
    accepted, rejected = details(r.usage)
    assert server.metric("leaplm_accepted_prediction_tokens_total") == before[0] + accepted
    assert server.metric("leaplm_rejected_prediction_tokens_total") == before[1] + rejected

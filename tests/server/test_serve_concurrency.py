"""Many users at once: 16 simultaneous streams, clients that disconnect mid-request."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from leaplm import SamplingParams

from serverkit import API_KEY, MODEL

PROMPTS = [f"{w} {i}" for i, w in enumerate(["the quick", "déjà vu", "def add(a", "東京 と", "speculative",
                                             "un café", "über", "hello", "🙂 🚀", "return a + b",
                                             "lazy dog", "crème", "emoji", "verifies them", "fox jumps",
                                             "naïve façade"])]


async def _stream(client, prompt: str, max_tokens: int, **kw) -> tuple[str, str, int]:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}, **kw)
    text, finish, usage = [], None, None
    async for c in stream:
        if c.choices:
            text.append(c.choices[0].text)
            finish = c.choices[0].finish_reason or finish
        if c.usage is not None:
            usage = c.usage.completion_tokens
    return "".join(text), finish, usage


def test_16_simultaneous_streams_are_correct_and_independent(aclient, reference, server):
    lengths = [16 + 4 * i for i in range(16)]          # they finish at different steps: rows leave and compact

    async def main():
        return await asyncio.gather(*[_stream(aclient, p, n) for p, n in zip(PROMPTS, lengths)])

    results = asyncio.run(main())
    for (text, finish, usage), p, n in zip(results, PROMPTS, lengths):
        ref = reference.generate(p, SamplingParams(max_new_tokens=n, temperature=0))
        assert text == ref.text, p
        assert finish == ref.finish_reason
        assert usage == len(ref.token_ids)
    assert server.metric("leaplm_engine_step_batch_size_count") > 0
    assert 'le="16.0"' in httpx.get(server.url + "/metrics").text


def test_mixed_speculation_settings_in_one_batch(aclient, reference):
    """Rows with speculation off, a small K and the server's K verified together."""
    variants = [{"speculative": {"method": "none"}}, {"speculative": {"method": "draft", "k": 1}}, {},
                {"speculative": {"method": "draft", "k": 6}}] * 2

    async def main():
        return await asyncio.gather(*[_stream(aclient, p, 30, extra_body=v) for p, v in zip(PROMPTS, variants)])

    for (text, _, _), p in zip(asyncio.run(main()), PROMPTS):
        assert text == reference.generate(p, SamplingParams(max_new_tokens=30, temperature=0)).text


def wait_for(cond, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def idle(server) -> bool:
    return (server.metric("leaplm_running_requests") == 0 and server.metric("leaplm_queue_depth") == 0
            and server.metric("leaplm_kv_cache_rows_in_use") == 0 and server.metric("leaplm_kv_cache_tokens") == 0)


LONG = {"model": MODEL, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}


def test_streaming_clients_that_disconnect_are_aborted_and_free_their_rows(server, reference):
    wait_for(lambda: idle(server), what="an idle server")
    aborted_before = server.metric("leaplm_request_finish_total", 'reason="abort"')

    async def main():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as h:
            async def leave_early(prompt):
                async with h.stream("POST", "/v1/completions", json={**LONG, "prompt": prompt, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and '"text"' in line:
                            return True             # leaving the block closes the connection mid-stream

            async def stay(prompt):
                r = await h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 40,
                                                           "temperature": 0})
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*[leave_early(p) for p in PROMPTS[:6]], stay(PROMPTS[6]))

    *left, kept = asyncio.run(main())
    assert all(left)
    assert kept == reference.generate(PROMPTS[6], SamplingParams(max_new_tokens=40, temperature=0)).text
    wait_for(lambda: idle(server), what="aborted requests to leave and free their rows")
    assert server.metric("leaplm_request_finish_total", 'reason="abort"') >= aborted_before + 6
    # a 1000-token request takes far longer than this test: nothing ran to completion behind our back
    generated = server.metric("leaplm_generation_tokens_total")
    time.sleep(0.3)
    assert server.metric("leaplm_generation_tokens_total") == generated


def test_non_streaming_client_that_disconnects_is_aborted(server):
    wait_for(lambda: idle(server), what="an idle server")
    aborted_before = server.metric("leaplm_request_finish_total", 'reason="abort"')
    headers = {"Authorization": f"Bearer {API_KEY}"}
    # plain decoding: 1000 target steps (about 0.3 s on the tiny pair; drafting takes a third less), the client
    # gives up after 0.05 s, while the request is still decoding
    body = {**LONG, "prompt": "the quick", "speculative": {"method": "none"}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(10, read=0.05))
    wait_for(lambda: idle(server), what="the abandoned request to be aborted")
    assert server.metric("leaplm_request_finish_total", 'reason="abort"') == aborted_before + 1


def test_server_works_after_aborts(client, reference):
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=20, temperature=0)
    assert r.choices[0].text == reference.generate("hello", SamplingParams(max_new_tokens=20, temperature=0)).text


def test_metrics_show_k_per_batch_size(server):
    text = httpx.get(server.url + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("leaplm_spec_decode_k_by_batch_size{")]
    assert lines, "no K-by-batch-size samples"
    ks = {int(json.loads(line.split('batch_size=')[1].split("}")[0])): float(line.split()[-1]) for line in lines}
    assert all(0 <= k <= 8 for k in ks.values())

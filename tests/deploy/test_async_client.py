"""examples/openai_async_client.py against a real leaplm server (in-process, 127.0.0.1): streamed text equals
plain decoding, retries happen only before the first token and honour Retry-After, a cancelled request is
aborted on the server, and the whole-request deadline holds."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
from serverkit import API_KEY, MODEL, InProcessServer, write_pair  # noqa: E402


def _load_example():
    spec = importlib.util.spec_from_file_location("openai_async_client", ROOT / "examples" / "openai_async_client.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                 # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


ex = _load_example()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("client_pair"))


@pytest.fixture(scope="module")
def server(pair):
    srv = InProcessServer(pair[0], pair[1], method="draft", k=4, max_batch=4, max_queue=16)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_streams_equal_plain_decoding_with_speculation_figures(server, pair):
    from leaplm import Engine
    from leaplm.config import SamplingParams

    prompts = ["the quick brown", "def add(a, b):", "speculative decoding"]
    argv = ["--base-url", server.url + "/v1", "--api-key", API_KEY, "--model", MODEL, "--max-tokens", "20"]
    for p in prompts:
        argv += ["--prompt", p]
    results = asyncio.run(ex.run(ex.parse_args(argv)))
    ref = Engine(pair[0], method="none")
    for r in results:
        assert r.error is None and r.attempts == 1
        want = ref.generate(r.prompt, SamplingParams(max_new_tokens=20, temperature=0.0))
        assert r.text == want.text and r.tokens == len(want.token_ids)
        assert r.speculative["method"] == "draft"          # the server's batch policy may still draft 0
        assert r.ttft_s is not None and r.ttft_s <= r.total_s


def _sse(texts: list[str]) -> bytes:
    out = b""
    for i, t in enumerate(texts):
        chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                 "choices": [{"index": 0, "text": t, "logprobs": None,
                              "finish_reason": "length" if i == len(texts) - 1 else None}]}
        out += b"data: " + json.dumps(chunk).encode() + b"\n\n"
    return out + b"data: [DONE]\n\n"


def _client(handler):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url="http://test/v1", api_key="k", max_retries=0,
                       http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def test_retries_before_the_first_token_honouring_retry_after():
    calls = []

    def handler(request):
        calls.append(time.perf_counter())
        if len(calls) < 3:
            return httpx.Response(429 if len(calls) == 1 else 503, headers={"retry-after": "0.2"},
                                  json={"error": {"message": "busy", "type": "x", "code": 429}})
        return httpx.Response(200, content=_sse(["a", "b"]), headers={"content-type": "text/event-stream"})

    r = asyncio.run(ex.stream_completion(_client(handler), "m", "p", retries=3, deadline_s=10))
    assert r.error is None and r.text == "ab" and r.attempts == 3
    assert calls[1] - calls[0] >= 0.2 and calls[2] - calls[1] >= 0.2          # Retry-After honoured


def test_gives_up_after_the_retries_and_reports_the_status():
    handler = lambda request: httpx.Response(503, json={"error": {"message": "loading", "type": "x", "code": 503}},  # noqa: E731
                                             headers={"retry-after": "0"})
    r = asyncio.run(ex.stream_completion(_client(handler), "m", "p", retries=1, deadline_s=10))
    assert r.attempts == 2 and r.error.startswith("HTTP 503")


def test_a_bad_request_is_not_retried():
    handler = lambda request: httpx.Response(400, json={"error": {"message": "max_tokens: bad", "type": "x",  # noqa: E731
                                                                  "code": 400}})
    r = asyncio.run(ex.stream_completion(_client(handler), "m", "p", retries=3, deadline_s=10))
    assert r.attempts == 1 and r.error.startswith("HTTP 400")


def test_cancel_after_aborts_the_request_on_the_server(server):
    before = server.metric("leaplm_request_finish_total", 'reason="abort"')
    # 30 ms: with the draft at full K the tiny model can finish 900 tokens in under 0.2 s
    argv = ["--base-url", server.url + "/v1", "--api-key", API_KEY, "--model", MODEL, "--max-tokens", "900",
            "--prompt", "the quick brown", "--cancel-after", "0.03"]
    t = time.perf_counter()
    results = asyncio.run(ex.run(ex.parse_args(argv)))
    assert results[0].error == "cancelled" and time.perf_counter() - t < 5
    deadline = time.monotonic() + 10
    while server.state.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.state.scheduler.running == 0
    assert server.metric("leaplm_request_finish_total", 'reason="abort"') == before + 1


def test_the_deadline_bounds_a_slow_stream(server):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    # the stream is made slow by its reader (10 ms a chunk): the tiny model alone can send 900 tokens in well
    # under the deadline, and the deadline bounds the whole request whichever side is slow
    r = asyncio.run(ex.stream_completion(client, MODEL, "the quick brown", max_tokens=900, deadline_s=0.3,
                                         on_text=lambda prompt, piece: time.sleep(0.01)))
    assert r.error == "deadline of 0.3 s exceeded" and r.total_s < 3
    assert r.text and r.finish_reason is None          # cut mid-stream, not finished

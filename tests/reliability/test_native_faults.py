"""Faults in the native paths, injected (leaplm/faults.py): a C++ exception thrown by the int8 kernel's layer loop,
a llama_decode that returns 1 (no free KV cells). The request whose forward fails ends with a clear error (a
streamed choice gets finish_reason "error" and an error event naming the failure, a whole answer a 500 with code
engine_error); the requests batched with it get the greedy text they get alone, the server keeps serving, and
the backends hold no cell, sequence or context for the failed request afterwards."""
from __future__ import annotations

import asyncio
import gc
import json

import httpx
import pytest

from gguf_servers import BACKENDS, FAULT_SITE, skip_unless_available, write_gguf_pair
from leaplm import faults
from serverkit import API_KEY, MODEL, InProcessServer

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["the quick brown", "def add(a", "un café"]
FAULT_AT = 96            # the first position whose forward fails: the long requests reach it, the short ones never
SHORT = 24               # tokens of a short request: its positions stay far below FAULT_AT (prompt + 24 + K)
LONG = {"model": MODEL, "prompt": "hello, how", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
WHAT_FAILED = {"kernel": "out of range", "llamacpp": "llama_decode failed (1: no free KV cells)"}


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    return write_gguf_pair(tmp_path_factory.mktemp("fault_pair"))


def _short(p: str) -> dict:
    return {"model": MODEL, "prompt": p, "max_tokens": SHORT, "temperature": 0}


async def _stream(h: httpx.AsyncClient, body: dict) -> list[dict]:
    events = []
    async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
    return events


async def _traffic(url: str):
    """A long stream and a long whole answer (both fail at FAULT_AT), and short requests from 3 clients for as
    long as the long ones run, then a round more."""
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=120) as h:
        longs = [asyncio.create_task(_stream(h, LONG)), asyncio.create_task(h.post("/v1/completions", json=LONG))]
        shorts: list[tuple[str, int, str]] = []

        async def client(i: int) -> None:
            rounds = 0
            while not all(t.done() for t in longs) or rounds < 1:
                if all(t.done() for t in longs):
                    rounds += 1
                p = PROMPTS[(i + len(shorts)) % len(PROMPTS)]
                r = await h.post("/v1/completions", json=_short(p))
                shorts.append((p, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))

        await asyncio.gather(*[client(i) for i in range(3)])
        return await longs[0], await longs[1], shorts


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_native_fault_ends_only_its_request(gguf_pair, backend, method, figures):
    skip_unless_available(backend)
    srv = InProcessServer(*gguf_pair, method=method, k=4, max_batch=4, max_queue=8,
                          engine_options=BACKENDS[backend])
    try:
        srv.wait_ready(300)                                   # the first use of the kernel may build it
        alone = {}
        for p in PROMPTS:                                     # each prompt alone, no fault: the reference
            r = httpx.post(srv.url + "/v1/completions", headers=HEADERS, json=_short(p), timeout=60)
            alone[p] = r.json()["choices"][0]["text"]
        gc.collect()      # the count is the process's: earlier tests' garbage contexts go first
        contexts = srv.metric("leaplm_llamacpp_contexts")
        errors_before = srv.metric("leaplm_request_finish_total", 'reason="error"')
        with faults.inject(FAULT_SITE[backend], FAULT_AT):
            streamed, whole, shorts = asyncio.run(_traffic(srv.url))
            after = httpx.post(srv.url + "/v1/completions", headers=HEADERS, json=_short(PROMPTS[0]), timeout=60)

        # the failed stream: text up to the fault, then finish_reason "error", the error event, [DONE]
        assert streamed[-1] == {"done": True}
        err = streamed[-2]["error"]
        assert err["code"] == "engine_error" and WHAT_FAILED[backend] in err["message"], err
        assert "\n" not in err["message"]                     # the C++ backtrace is not sent
        assert streamed[-3]["choices"][0]["finish_reason"] == "error"
        assert sum(len(e["choices"][0]["text"]) for e in streamed[:-3]) > 0
        # the failed whole answer: a 500 naming the failure
        assert whole.status_code == 500
        assert whole.json()["error"]["code"] == "engine_error" and WHAT_FAILED[backend] in whole.text
        # everything batched with them: greedy text as alone
        assert shorts and all(code == 200 for _, code, _ in shorts), [s for s in shorts if s[1] != 200][:3]
        assert [(p, t) for p, _, t in shorts if t != alone[p]] == []
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == alone[PROMPTS[0]]
        assert srv.metric("leaplm_request_finish_total", 'reason="error"') - errors_before == 2
        # nothing held for anyone once idle, counted by the backends; no context made or lost
        held = {f"{g}_{c}": srv.metric(f"leaplm_native_{g}", f'cache="{c}"')
                for g in ("kv_cells", "sequences") for c in ("target", "draft")}
        assert not any(held.values()), held
        gc.collect()
        assert srv.metric("leaplm_llamacpp_contexts") == contexts
        assert srv.metric("leaplm_kv_cache_rows_in_use") == 0 and srv.metric("leaplm_kv_cache_reserved_tokens") == 0
        figures.update(requests=len(shorts) + 3, failed=2, short_mismatches=0, leaked_cells=0,
                       contexts=contexts)
    finally:
        srv.stop()


def test_fault_spec_is_checked():
    assert faults.parse("kernel@10, llamacpp@0") == {"kernel": 10, "llamacpp": 0}
    assert faults.parse("") == {}
    for bad in ("kernel", "gpu@3", "kernel@-1", "kernel@x"):
        with pytest.raises(Exception, match=faults.ENV):
            faults.parse(bad)

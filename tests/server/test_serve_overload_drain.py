"""Overload (fast 429s) and draining: the drain-timeout path in process, a real SIGTERM on a `leaplm serve`
subprocess."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from serverkit import API_KEY, MODEL, InProcessServer, ServerProcess

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# one token per step (speculation off) and 1000 of them: 0.2-0.4 s each on the tiny pair, well beyond the drain timeout
LONG = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
        "stream": True, "speculative": {"method": "none"}}
SHORT = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


def wait_for(cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def small_server(tiny_pair):
    """One row, two waiting places, a drain timeout of 50 ms."""
    srv = InProcessServer(*tiny_pair, max_batch=1, max_queue=2, drain_timeout_s=0.05)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


async def _open_stream(h: httpx.AsyncClient, events: list, body: dict) -> None:
    async with h.stream("POST", "/v1/completions", json=body) as r:
        events.append(("status", r.status_code))
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(("data", line[6:]))


async def _fill(h: httpx.AsyncClient, events: list[list]) -> list[asyncio.Task]:
    """One running request, then two waiting ones (opened in that order: three at once could race the
    scheduler's admission and meet a full queue)."""
    async def metric_is(text: str) -> bool:
        for _ in range(1500):
            if text in (await h.get("/metrics")).text:
                return True
            await asyncio.sleep(0.02)
        raise AssertionError(f"/metrics never showed {text!r}")

    tasks = [asyncio.create_task(_open_stream(h, events[0], LONG))]
    await metric_is("leaplm_running_requests 1.0")
    tasks += [asyncio.create_task(_open_stream(h, ev, LONG)) for ev in events[1:]]
    await metric_is("leaplm_queue_depth 2.0")
    return tasks


def test_overload_gets_fast_429_with_retry_after(small_server):
    srv = small_server

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60) as h:
            events = [[], [], []]
            tasks = await _fill(h, events)
            refused = []
            for _ in range(8):
                t = time.perf_counter()
                r = await h.post("/v1/completions", json=SHORT)
                refused.append((r, time.perf_counter() - t))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return refused

    refused = asyncio.run(main())
    for r, seconds in refused:
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "max_queue" in err["message"]
        assert seconds < 1.0
    wait_for(lambda: srv.metric("leaplm_running_requests") == 0 and srv.metric("leaplm_queue_depth") == 0,
             what="cancelled streams to be aborted")
    assert srv.metric("leaplm_requests_total", 'endpoint="/v1/completions",status="429"') == 8
    r = httpx.post(srv.url + "/v1/completions", json=SHORT, headers=HEADERS, timeout=30)
    assert r.status_code == 200


def test_drain_timeout_aborts_what_is_left(small_server):
    """Runs last on small_server: a drain (what SIGTERM starts) with a 50 ms timeout while one request runs and
    two wait."""
    srv = small_server

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60) as h:
            events = [[], [], []]
            tasks = await _fill(h, events)
            drained = asyncio.create_task(asyncio.to_thread(srv.drain))
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
            await asyncio.wait_for(drained, 30)
            return events

    events = asyncio.run(main())
    errors = [json.loads(d)["error"] for ev in events for kind, d in ev
              if kind == "data" and d != "[DONE]" and "error" in json.loads(d)]
    assert len(errors) >= 2                      # at least the two waiting requests never ran to the end
    assert all("shutting down" in e["message"] for e in errors)
    assert all(ev[-1] == ("data", "[DONE]") for ev in events)
    assert not srv.thread.is_alive()                 # the server exited after the drain


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tiny_pair):
    srv = ServerProcess(*tiny_pair, "--drain-timeout", "60")
    try:
        srv.wait_ready()

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60) as h:
                events: list = []
                task = asyncio.create_task(_open_stream(h, events, LONG))
                while not any(kind == "data" for kind, _ in events):
                    await asyncio.sleep(0.01)
                srv.proc.send_signal(signal.SIGTERM)
                for _ in range(500):
                    health = await h.get("/health")
                    if health.status_code == 503:
                        break
                    await asyncio.sleep(0.01)
                refused = await h.post("/v1/completions", json=SHORT)
                assert not task.done(), "the long request finished before the checks; make it longer"
                await asyncio.wait_for(task, 60)
                return health, refused, events

        health, refused, events = asyncio.run(main())
        assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        data = [d for kind, d in events if kind == "data"]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all("error" not in c for c in chunks)
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()

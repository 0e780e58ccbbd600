"""Overload and admission: the queue limit is counted in sequences (prompts x n) with running ones included,
429s come fast with a Retry-After derived from the measured drain rate, nothing hangs, and the KV-cache budget
refuses what can never fit (400 naming the field) and what cannot fit now (429). The burst also runs on the tiny
pair as GGUF files through both native paths (the int8 kernel, libllama) with speculation, where the backends'
own counts of KV cells and sequences must be back to 0 afterwards."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import rawhttp
from gguf_servers import BACKENDS, cli_args, skip_unless_available, write_gguf_pair
from serverkit import API_KEY, MODEL, InProcessServer, ServerProcess

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# one token per step and 300 of them: each runs for a while
LONG = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
        "speculative": {"method": "none"}}


@pytest.fixture(scope="module")
def busy_server(tiny_pair):
    """2 rows, 2 waiting places: 4 sequences in flight at most. A cache budget of 1000 tokens."""
    from leaplm.server.admission import bytes_per_token

    probe = InProcessServer(*tiny_pair, max_batch=2, max_queue=2)
    probe.wait_ready()
    per_token = bytes_per_token(probe.state.scheduler.cache)
    probe.stop()
    srv = InProcessServer(*tiny_pair, max_batch=2, max_queue=2, kv_cache_bytes=int(1000 * per_token))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


async def _wait_metric(h: httpx.AsyncClient, text: str) -> None:
    for _ in range(1500):
        if text in (await h.get("/metrics")).text:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"/metrics never showed {text!r}")


def test_queue_limit_counts_sequences_including_running(busy_server):
    """Two running + one waiting: a request of 2 sequences (n=2) no longer fits the 4 places; 1 sequence does."""
    srv = busy_server

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60) as h:
            tasks = [asyncio.create_task(h.post("/v1/completions", json=LONG)) for _ in range(2)]
            await _wait_metric(h, "leaplm_running_requests 2.0")
            tasks.append(asyncio.create_task(h.post("/v1/completions", json=dict(LONG, max_tokens=40))))
            await _wait_metric(h, "leaplm_queue_depth 1.0")
            two = await h.post("/v1/completions", json=dict(LONG, n=2, max_tokens=4))
            one = await h.post("/v1/completions", json=dict(LONG, max_tokens=4))
            await asyncio.gather(*tasks)
            return two, one

    two, one = asyncio.run(main())
    assert two.status_code == 429, two.text
    err = rawhttp.openai_error(two.content)
    assert err["code"] == "queue_full" and "sequences" in err["message"]
    assert int(two.headers["Retry-After"]) >= 1
    assert one.status_code == 200, one.text


def test_one_request_may_fill_the_server_but_not_exceed_it(busy_server):
    """2 prompts x n=2 = 4 sequences fit an idle server of 2 rows + 2 waiting places (2 run, 2 wait); 3 x 2 = 6
    never fit (400 naming n)."""
    ok = httpx.post(busy_server.url + "/v1/completions", headers=HEADERS, timeout=30,
                    json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 4
    r = httpx.post(busy_server.url + "/v1/completions", headers=HEADERS, timeout=30,
                   json={"model": MODEL, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
    assert r.status_code == 400
    err = rawhttp.openai_error(r.content)
    assert err["param"] == "n" and "max_batch + max_queue" in err["message"]


def test_never_fits_the_cache_budget_is_400_naming_max_tokens(busy_server):
    r = httpx.post(busy_server.url + "/v1/completions", headers=HEADERS, timeout=30,
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 1010})
    assert r.status_code == 400, r.text
    err = rawhttp.openai_error(r.content)
    assert err["param"] == "max_tokens" and err["code"] == "cache_budget_exceeded" and "1000" in err["message"]


def test_never_fits_the_cache_budget_is_400_naming_the_prompt(busy_server):
    r = httpx.post(busy_server.url + "/v1/completions", headers=HEADERS, timeout=30,
                   json={"model": MODEL, "prompt": [5] * 1001, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = rawhttp.openai_error(r.content)
    assert err["param"] == "prompt"


def test_fits_later_is_429_with_drain_rate_retry_after(busy_server):
    """Two sequences reserving 2 x 304 tokens run: a third of 500 does not fit the 1000-token budget now (429,
    code cache_full, Retry-After from the drain rate), and fits once they finish."""
    srv = busy_server

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60) as h:
            # finishes to measure the drain rate from
            await asyncio.gather(*[h.post("/v1/completions", json=dict(LONG, max_tokens=8)) for _ in range(4)])
            tasks = [asyncio.create_task(h.post("/v1/completions", json=LONG)) for _ in range(2)]
            await _wait_metric(h, "leaplm_running_requests 2.0")
            t = time.perf_counter()
            later = await h.post("/v1/completions", json=dict(LONG, max_tokens=500))
            took = time.perf_counter() - t
            await asyncio.gather(*tasks)
            after = await h.post("/v1/completions", json=dict(LONG, max_tokens=500))
            return later, took, after

    later, took, after = asyncio.run(main())
    assert later.status_code == 429, later.text
    assert rawhttp.openai_error(later.content)["code"] == "cache_full"
    assert 1 <= int(later.headers["Retry-After"]) <= 60
    assert took < 1.0
    assert after.status_code == 200, after.text
    assert srv.metric("leaplm_kv_cache_reserved_tokens") == 0


def test_retry_after_follows_the_drain_rate():
    from leaplm.server.admission import DrainRate

    d = DrainRate()
    assert d.retry_after(sequences=10) == 1                 # nothing measured yet: the floor
    for i in range(11):
        d.record(100, now=i * 0.5)                           # 2 sequences/s, 200 tokens/s
    assert d.retry_after(sequences=10) == 5
    assert d.retry_after(tokens=1000) == 5
    assert d.retry_after(sequences=1000) == 60               # capped
    fast = DrainRate()
    for i in range(11):
        fast.record(100, now=i * 0.01)
    assert fast.retry_after(sequences=10) == 1


def test_burst_gets_fast_429s_and_nothing_hangs(busy_server):
    """64 simultaneous requests against 4 places: every one is answered (200 or 429) well before its timeout,
    every 429 before any admitted request has finished (a refusal that waited for a place could not), and the
    server is idle with no row held afterwards."""
    _burst(busy_server, dict(LONG, max_tokens=120))       # admitted requests run for a while: waiting would show


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    return write_gguf_pair(tmp_path_factory.mktemp("overload_pair"))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_burst_on_gguf_gets_fast_429s_and_leaves_nothing(gguf_pair, backend):
    """The burst against `leaplm serve` on each native path (2 rows, 2 waiting places), speculating with the draft
    model: the same answers, and afterwards no KV cell or sequence held as the backend counts them."""
    skip_unless_available(backend)
    srv = ServerProcess(*gguf_pair, "--max-batch", "2", "--max-queue", "2", "--k", "4", "--method", "draft",
                        *cli_args(backend))
    try:
        srv.wait_ready(600)
        _burst(srv, dict(LONG, max_tokens=120, speculative={"method": "draft"}))
        native = {(m, c): srv.metric(m, f'cache="{c}"') for m in ("leaplm_native_kv_cells", "leaplm_native_sequences")
                  for c in ("target", "draft")}
        assert not any(native.values()), native
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-2000:]


def _burst(srv, body: dict) -> None:
    async def one(h):
        t = time.perf_counter()
        r = await h.post("/v1/completions", json=body)
        return r.status_code, time.perf_counter() - t, r.headers.get("Retry-After")

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60, limits=limits) as h:
            return await asyncio.wait_for(asyncio.gather(*[one(h) for _ in range(64)]), 60)

    got = asyncio.run(main())
    codes = [c for c, _, _ in got]
    assert set(codes) <= {200, 429} and codes.count(200) >= 4
    first_done = min(s for c, s, _ in got if c == 200)
    assert all(s < first_done for c, s, _ in got if c == 429), (first_done, sorted(s for c, s, _ in got if c == 429))
    assert all(ra is not None and int(ra) >= 1 for c, _, ra in got if c == 429)
    for _ in range(200):
        if srv.metric("leaplm_running_requests") == 0 and srv.metric("leaplm_queue_depth") == 0:
            break
        time.sleep(0.02)
    assert srv.metric("leaplm_kv_cache_rows_in_use") == 0
    assert srv.metric("leaplm_kv_cache_reserved_tokens") == 0

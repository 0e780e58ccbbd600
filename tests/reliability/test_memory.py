"""What the server holds, told through /metrics, so an operator (or an orchestrator's memory limit) can see it
before the kernel's out-of-memory killer does: resident memory, the KV cache's bytes, the admission budget and
what admitted sequences have reserved from it (prompt + max_tokens each, returned when they finish)."""
from __future__ import annotations

import asyncio

import httpx

from serverkit import API_KEY, MODEL, InProcessServer

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _vm_rss() -> float:
    with open("/proc/self/status") as f:
        return next(float(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_metrics_tell_the_memory_held_and_reserved(tiny_pair):
    from leaplm.server.admission import bytes_per_token, cache_bytes

    srv = InProcessServer(*tiny_pair, max_batch=2, max_queue=2, kv_cache_bytes=10**6)
    try:
        srv.wait_ready()
        cache = srv.state.scheduler.cache
        per_token = bytes_per_token(cache)
        assert srv.metric("leaplm_kv_cache_bytes") == cache_bytes(cache) > 0
        assert srv.metric("leaplm_kv_cache_budget_tokens") == int(10**6 // per_token)
        # the in-process server shares this process: its resident memory is ours, within what moved meanwhile
        rss = srv.metric("process_resident_memory_bytes")
        assert abs(rss - _vm_rss()) < 0.05 * rss
        body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 300, "temperature": 0,
                "ignore_eos": True, "speculative": {"method": "none"}}

        async def main() -> float:
            async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60) as h:
                task = asyncio.create_task(h.post("/v1/completions", json=body))
                for _ in range(1000):
                    if srv.metric("leaplm_running_requests") == 1:
                        break
                    await asyncio.sleep(0.01)
                reserved = srv.metric("leaplm_kv_cache_reserved_tokens")
                r = await task
                assert r.status_code == 200
                return reserved, r.json()["usage"]["prompt_tokens"]

        reserved, prompt_tokens = asyncio.run(main())
        assert reserved == prompt_tokens + 300
        assert srv.metric("leaplm_kv_cache_reserved_tokens") == 0
    finally:
        srv.stop()


def test_request_that_would_grow_the_cache_past_available_memory_is_503(tiny_pair, monkeypatch):
    """The torch cache grows with its rows: a request whose sequence would make it grow past 90% of the memory
    available is refused (503 insufficient_memory naming max_tokens, with Retry-After) instead of an OOM kill;
    one that fits the storage the cache has now still runs."""
    import leaplm.server.admission as admission

    srv = InProcessServer(*tiny_pair, max_batch=2, max_queue=2)
    try:
        srv.wait_ready()
        cache = srv.state.scheduler.cache
        now = admission.cache_bytes(cache)
        monkeypatch.setattr(admission, "available_memory", lambda: now)       # room for this much more, no further
        body = {"model": MODEL, "prompt": "the quick brown fox", "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", headers=HEADERS, timeout=60,
                       json={**body, "max_tokens": cache.max_len - 16})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "insufficient_memory" and err["param"] == "max_tokens" and "MiB" in err["message"]
        assert int(r.headers["Retry-After"]) >= 1
        ok = httpx.post(srv.url + "/v1/completions", headers=HEADERS, timeout=60, json={**body, "max_tokens": 8})
        assert ok.status_code == 200, ok.text
        assert srv.metric("leaplm_kv_cache_reserved_tokens") == 0
    finally:
        srv.stop()

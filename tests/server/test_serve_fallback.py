"""A model served through the transformers fallback (one sequence per forward) runs under serve's defaults
(8 batch rows asked for): one row, the other requests queue, every request answered, none crashes."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serverkit import InProcessServer


@pytest.mark.parametrize("name", ["gpt2", "llama_longrope"])
def test_fallback_serves_concurrent_requests(name, checkpoint):
    srv = InProcessServer(checkpoint(name), None, method="none", api_key=None)     # max_batch 8 by default
    try:
        srv.wait_ready()
        assert srv.state.scheduler.max_batch == 1

        def ask(i: int) -> httpx.Response:
            return httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": f"the quick brown fox {i}", "max_tokens": 8, "temperature": 0})

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, range(3)))
        assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
        assert all(r.json()["choices"][0]["text"] for r in answers)
    finally:
        srv.stop()

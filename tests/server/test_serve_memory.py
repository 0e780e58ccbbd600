"""serve with defaults on a model whose config allows 131072 positions: the KV cache follows the requests (asserted
on /metrics' allocated cache bytes, not RSS), far below preallocating every position of every row."""
from __future__ import annotations

import httpx

from serverkit import InProcessServer

POSITIONS = 131072
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8          # the long_context_llama fixture (tests/conftest.py)
PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4


def test_serve_defaults_stay_far_below_preallocation(long_context_llama):
    from serverkit import InProcessServer

    srv = InProcessServer(long_context_llama, None, method="none", api_key=None)   # default 8 rows
    try:
        srv.wait_ready()
        for n in (10, 300):                                        # the second request crosses a chunk
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "t1 t2 t3", "max_tokens": n,
                                                              "ignore_eos": True, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
        peak = srv.metric("leaplm_kv_cache_peak_bytes")
        now = srv.metric("leaplm_kv_cache_bytes")
        assert srv.state.engine.max_model_len == 4096
        rows = srv.state.scheduler.cache.batch_size
        assert rows == 8
        assert 0 < now <= peak <= rows * 512 * PER_TOKEN   # 303 tokens: two chunks
        assert peak * 100 < rows * POSITIONS * PER_TOKEN       # what preallocating would take
    finally:
        srv.stop()

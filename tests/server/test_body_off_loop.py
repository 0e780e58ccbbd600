"""Large request bodies are decoded in the body pool, off the event loop; small ones in place. Told by the thread
the decoder runs in (the decoder patched to record it), not by timing."""
from __future__ import annotations

import threading

import httpx

from serverkit import MODEL


def test_a_large_body_is_decoded_off_the_event_loop_and_a_small_one_on_it(server, monkeypatch):
    from leaplm.server import body

    seen: list[tuple[int, str]] = []
    real = body.decode_json

    def recording(raw: bytes):
        seen.append((len(raw), threading.current_thread().name))
        return real(raw)

    monkeypatch.setattr(body, "decode_json", recording)
    off_before = server.metric("leaplm_request_bodies_decoded_off_loop_total")
    h = httpx.Client(base_url=server.url, headers=server.headers, timeout=60)
    request = {"model": MODEL, "prompt": "the quick", "max_tokens": 2, "temperature": 0}
    large = h.post("/v1/completions", json=dict(request, user="u" * body.OFF_LOOP_BYTES))
    small = h.post("/v1/completions", json=dict(request, user="u"))
    assert large.status_code == 200 and small.status_code == 200, (large.text, small.text)
    assert large.json()["choices"][0]["text"] == small.json()["choices"][0]["text"]
    (n_large, t_large), (n_small, t_small) = seen
    assert n_large >= body.OFF_LOOP_BYTES and t_large.startswith("leaplm-body")
    assert n_small < body.OFF_LOOP_BYTES and t_small == server.thread.name        # uvicorn's event-loop thread
    assert server.metric("leaplm_request_bodies_decoded_off_loop_total") == off_before + 1


def test_a_large_malformed_body_gets_the_same_400_as_a_small_one(server):
    from leaplm.server.body import OFF_LOOP_BYTES

    h = httpx.Client(base_url=server.url, headers={**server.headers, "content-type": "application/json"}, timeout=60)
    for pad in (0, OFF_LOOP_BYTES):
        raw = b'{"model": "' + MODEL.encode() + b'", "user": "' + b"u" * pad + b'", "prompt": }'
        r = h.post("/v1/completions", content=raw)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_json" and f"at byte {len(raw) - 1}" in err["message"], err
    bad_utf8 = b'{"model": "' + MODEL.encode() + b'", "user": "' + b"u" * OFF_LOOP_BYTES + b'\xff"}'
    r = h.post("/v1/completions", content=bad_utf8)
    assert r.status_code == 400 and "error" in r.json(), r.text

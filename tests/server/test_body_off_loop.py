"""Large request bodies are decoded and validated in the body pool, off the event loop; small ones in place. Told
by the thread the decoder runs in (the decoder patched to record it), not by timing. Either way a body gets the
same answer."""
from __future__ import annotations

import threading

import httpx
import pytest

from serverkit import MODEL


@pytest.fixture
def h(server):
    return httpx.Client(base_url=server.url, headers={**server.headers, "content-type": "application/json"},
                        timeout=60)


def test_a_large_body_is_decoded_and_validated_off_the_event_loop_and_a_small_one_on_it(server, h, monkeypatch):
    from leaplm.server import body
    from leaplm.server.protocol import ChatCompletionRequest

    decoded: list[tuple[int, str]] = []
    validated: list[tuple[str, object]] = []
    real_decode, real_validate = body.decode_json, body.decode_and_validate

    def recording_decode(raw: bytes):
        decoded.append((len(raw), threading.current_thread().name))
        return real_decode(raw)

    def recording_validate(raw: bytes, field):
        out = real_validate(raw, field)
        validated.append((threading.current_thread().name, out))
        return out

    from leaplm.server import middleware

    digested: list[str] = []
    real_digest = middleware._digest

    def recording_digest(head: bytes, raw: bytes):
        digested.append(threading.current_thread().name)
        return real_digest(head, raw)

    monkeypatch.setattr(body, "decode_json", recording_decode)
    monkeypatch.setattr(body, "decode_and_validate", recording_validate)
    monkeypatch.setattr(middleware, "_digest", recording_digest)
    off_before = server.metric("leaplm_request_bodies_decoded_off_loop_total")
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    large = h.post("/v1/chat/completions", json=dict(request, user="u" * body.OFF_LOOP_BYTES))
    small = h.post("/v1/chat/completions", json=dict(request, user="u"))
    assert large.status_code == 200 and small.status_code == 200, (large.text, small.text)
    assert large.json()["choices"][0]["message"] == small.json()["choices"][0]["message"]
    (n_large, t_large), (n_small, t_small) = decoded
    assert n_large >= body.OFF_LOOP_BYTES and t_large.startswith("leaplm-body")
    assert n_small < body.OFF_LOOP_BYTES and t_small == server.thread.name        # uvicorn's event-loop thread
    [(t_valid, model)] = validated                                               # the large one alone
    assert digested[0].startswith("leaplm-body") and digested[1] == server.thread.name    # the refusal digests
    assert t_valid.startswith("leaplm-body") and isinstance(model, ChatCompletionRequest)
    assert server.metric("leaplm_request_bodies_decoded_off_loop_total") == off_before + 1


@pytest.mark.parametrize("pad", [0, 32 << 10])
def test_a_large_malformed_body_gets_the_same_400_as_a_small_one(h, pad):
    raw = b'{"model": "' + MODEL.encode() + b'", "user": "' + b"u" * pad + b'", "prompt": }'
    r = h.post("/v1/completions", content=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and f"at byte {len(raw) - 1}" in err["message"], err
    r = h.post("/v1/completions", content=raw[:-3] + b'"a", "user": "\xff"}')
    assert r.status_code == 400 and "error" in r.json(), r.text


@pytest.mark.parametrize("pad", [0, 32 << 10])
@pytest.mark.parametrize("fields, param", [({"n": 0}, "n"), ({"stop": "\ud800"}, "stop"),
                                           ({"best_of": 3}, "best_of"), ({"no_such_field": 1}, "no_such_field")])
def test_a_large_invalid_body_gets_the_same_400_as_a_small_one(h, pad, fields, param):
    import json

    body = {"model": MODEL, "prompt": "a", "user": "u" * pad, **fields}
    r = h.post("/v1/completions", content=json.dumps(body).encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param

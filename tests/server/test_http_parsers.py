"""Both HTTP parsers the server runs on (ServerConfig.http_parser: httptools, in C, and h11) carry the same guards:
malformed HTTP and an oversized head get OpenAI-shaped 400s, a trickled request a 408 within the read deadline,
an idle socket is closed; and a stream's text is the same on both. tests/reliability/test_http_hardening.py runs
the full set on the default parser."""
from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from leaplm.config import ConfigError, ServerConfig
from leaplm.server.http_protocol import MAX_HEAD_BYTES, protocol_class

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
import rawhttp  # noqa: E402
from serverkit import API_KEY, MODEL, InProcessServer  # noqa: E402

import httptools  # noqa: F401  (a dependency: the parser the server picks)
PARSERS = ("httptools", "h11")


@pytest.fixture(scope="module", params=PARSERS)
def srv(request, tiny_pair):
    s = InProcessServer(*tiny_pair, k=4, max_batch=2, max_queue=4, request_read_timeout_s=1.0,
                        keep_alive_timeout_s=1.0, http_parser=request.param)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_the_configured_parser_is_the_one_that_runs(srv):
    assert srv.state.config.http_parser in PARSERS
    cls = protocol_class(srv.state.config)
    assert ("HttpTools" in cls.__name__) == (srv.state.config.http_parser == "httptools")


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 10),     # and no end
], ids=["not-http", "bad-header-line", "two-content-lengths", "bad-chunk", "endless-head"])
def test_malformed_http_gets_an_openai_400(srv, raw):
    status, headers, body = rawhttp.parse(rawhttp.exchange(srv.url, raw))
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert rawhttp.openai_error(body)["code"] == "invalid_http"


def test_a_trickled_body_gets_a_408_and_the_socket_closes(srv):
    s = rawhttp.connect(srv.url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n").encode()
    try:
        s.sendall(head + b'{"model": "tiny",')
        got = rawhttp.read_all(s, 6.0)
    finally:
        s.close()
    status, _, body = rawhttp.parse(got)
    assert status == 408 and rawhttp.openai_error(body)["code"] == "request_timeout"


def test_trickled_headers_get_a_408(srv):
    s = rawhttp.connect(srv.url)
    got = b""
    try:
        for b in f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nX-Slow: ".encode() + b"a" * 30:
            try:
                s.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                break
            s.settimeout(0.1)
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            except ConnectionResetError:
                break
            got += chunk
            if not chunk:
                break
    finally:
        s.close()
    if got:                       # else the reset overtook the 408 (a byte was on its way as the server closed)
        status, _, body = rawhttp.parse(got)
        assert status == 408 and rawhttp.openai_error(body)["code"] == "request_timeout"


def test_an_idle_socket_and_an_idle_keep_alive_connection_are_closed(srv):
    idle = rawhttp.connect(srv.url)
    kept = rawhttp.connect(srv.url)
    try:
        kept.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode())
        kept.settimeout(5)
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        assert rawhttp.closed_within(idle, 5.0) is not None
        assert rawhttp.closed_within(kept, 5.0) is not None
    finally:
        idle.close()
        kept.close()


def test_a_keep_alive_connection_serves_requests_one_after_another(srv):
    with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=30) as h:
        for _ in range(3):
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": "the quick", "max_tokens": 3,
                                                "temperature": 0})
            assert r.status_code == 200, r.text
            time.sleep(0.2)


def _stream_text(url: str, headers: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": "über Straße", "max_tokens": 12, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def test_a_stream_is_the_same_on_both_parsers(srv, server):
    import json

    def texts(lines):
        assert lines[-1] == "data: [DONE]"
        return [json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]]

    # chunk boundaries follow the steps (what each one accepted), the text does not
    assert "".join(texts(_stream_text(srv.url, srv.headers))) == "".join(texts(_stream_text(server.url,
                                                                                           server.headers)))


def test_an_unknown_parser_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as e:
        ServerConfig(http_parser="picohttp")
    assert e.value.field == "http_parser"

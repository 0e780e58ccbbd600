"""Abusive and broken HTTP clients: idle and slow connections (slowloris), foreign Host headers (DNS rebinding),
auth scheme spelling, malformed HTTP and bodies. Every refusal is in OpenAI's error shape with a code."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

import rawhttp
from serverkit import API_KEY, MODEL

GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0}


def host_of(srv) -> str:
    return f"127.0.0.1:{srv.port}"


# --- authentication ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_auth_scheme_is_case_insensitive(server, scheme):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=10)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", [f"bearer {API_KEY}x", f"Basic {API_KEY}", API_KEY, f"bearer{API_KEY}", ""])
def test_wrong_credentials_still_refused(server, value):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": value}, timeout=10)
    assert r.status_code == 401
    assert rawhttp.openai_error(r.content)["code"] == "invalid_api_key"


# --- Host header (DNS rebinding) ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics", "/openapi.json"])
def test_foreign_host_header_refused(server, path):
    r = httpx.get(server.url + path, headers={"Host": "attacker.example", **server.headers}, timeout=10)
    assert r.status_code == 400, r.text
    err = rawhttp.openai_error(r.content)
    assert err["code"] == "invalid_host" and "attacker.example" in err["message"]


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "127.0.0.1",
                                  "localhost", "[::1]:{port}"])
def test_loopback_host_names_accepted(server, host):
    r = httpx.get(server.url + "/health", headers={"Host": host.format(port=server.port)}, timeout=10)
    assert r.status_code == 200, r.text


def test_missing_host_header_refused(server):
    raw = rawhttp.exchange(server.url, b"GET /health HTTP/1.0\r\n\r\n")
    status, _, body = rawhttp.parse(raw)
    assert status == 400
    assert rawhttp.openai_error(body)["code"] == "invalid_host"


# --- malformed HTTP and bodies ------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Name: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    b"GET /h\xffalth HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
], ids=["not-http", "bad-header-line", "space-in-header-name", "two-content-lengths", "bad-chunk", "non-ascii-target"])
def test_malformed_http_gets_openai_error(server, raw):
    status, headers, body = rawhttp.parse(rawhttp.exchange(server.url, raw))
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    err = rawhttp.openai_error(body)
    assert err["type"] == "invalid_request_error"
    assert server.metric("leaplm_requests_total", 'endpoint="other",status="500"') == 0


@pytest.mark.parametrize("body", [b'\xff\xfe{"model": "tiny"}', b'{"model": "tiny", "prompt": "\xc3\x28"}',
                                  b'{"model": "tiny", "prompt": "\xed\xa0\x80"}'],
                         ids=["bom-garbage", "bad-utf8-in-string", "encoded-surrogate"])
def test_non_utf8_body_gets_openai_error(server, body):
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"Content-Type": "application/json", **server.headers}, timeout=10)
    assert r.status_code == 400, r.text
    assert rawhttp.openai_error(r.content)["code"] in ("invalid_json", "invalid_value")


# --- slow and idle clients ----------------------------------------------------------------------------------------
def test_idle_connection_is_closed(server):
    """A client that connects and sends nothing is dropped after the read timeout (1 s here)."""
    s = rawhttp.connect(server.url)
    try:
        took = rawhttp.closed_within(s, 5.0)
    finally:
        s.close()
    assert took is not None and took < 3.0, f"idle connection still open ({took})"


def test_slowloris_headers_are_timed_out(server):
    """Headers dribbled one byte every 0.2 s never complete: the server answers 408 and closes within the read
    timeout, however steady the trickle."""
    s = rawhttp.connect(server.url)
    head = f"GET /health HTTP/1.1\r\nHost: {host_of(server)}\r\nX-Slow: " .encode() + b"a" * 100
    t = time.monotonic()
    got = b""
    try:
        for b in head:
            try:
                s.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                break
            s.settimeout(0.2)
            try:
                chunk = s.recv(65536)
                got += chunk
                if not chunk:
                    break
            except socket.timeout:
                pass
            except ConnectionResetError:   # closed by the server while a byte was on its way
                break
            if time.monotonic() - t > 8:
                break
        try:
            got += rawhttp.read_all(s, 1.0)
        except ConnectionResetError:
            pass
    finally:
        s.close()
    took = time.monotonic() - t
    assert took < 4.0, f"slowloris held the connection for {took:.1f} s"
    if not got:           # the reset overtook the 408 (a byte was in flight when the server closed): still closed
        return
    status, _, body = rawhttp.parse(got)
    assert status == 408
    assert rawhttp.openai_error(body)["code"] == "request_timeout"


def test_slow_body_is_timed_out(server):
    s = rawhttp.connect(server.url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host_of(server)}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n").encode()
    t = time.monotonic()
    try:
        s.sendall(head + b'{"model": "tiny",')
        got = rawhttp.read_all(s, 6.0)
    finally:
        s.close()
    took = time.monotonic() - t
    assert took < 4.0, f"a half-sent body held the connection for {took:.1f} s"
    status, _, body = rawhttp.parse(got)
    assert status == 408
    assert rawhttp.openai_error(body)["code"] == "request_timeout"


def test_idle_keep_alive_connection_is_closed(server):
    s = rawhttp.connect(server.url)
    try:
        s.sendall(f"GET /health HTTP/1.1\r\nHost: {host_of(server)}\r\n\r\n".encode())
        s.settimeout(5)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        took = rawhttp.closed_within(s, 5.0)
    finally:
        s.close()
    assert took is not None and took < 3.0


def test_many_idle_sockets_neither_block_service_nor_linger(server):
    """300 connections that send nothing: /health still answers at once, and all are closed after the timeout."""
    socks = [rawhttp.connect(server.url) for _ in range(300)]
    try:
        t = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t < 1.0
        time.sleep(2.5)
        still_open = sum(rawhttp.closed_within(s, 0.5) is None for s in socks[:20])
    finally:
        for s in socks:
            s.close()
    assert still_open == 0


# --- configuration ------------------------------------------------------------------------------------------------
def test_allowed_hosts_configuration():
    from leaplm.config import ConfigError, ServerConfig
    from leaplm.server.hosts import allowed, default_allowed_hosts

    assert ServerConfig(allowed_hosts="api.example, localhost").allowed_hosts == ("api.example", "localhost")
    for bad in ("", "a b", "http://x/", ","):
        with pytest.raises(ConfigError) as e:
            ServerConfig(allowed_hosts=bad)
        assert e.value.field == "allowed_hosts"
    for name in ("request_read_timeout_s", "keep_alive_timeout_s"):
        for bad in (0, -1, float("nan"), float("inf"), 1e300, "5"):
            with pytest.raises(ConfigError) as e:
                ServerConfig(**{name: bad})
            assert e.value.field == name
    assert default_allowed_hosts("0.0.0.0") is None and default_allowed_hosts("127.0.0.1") is not None
    assert allowed("api.example:443", ("api.example",)) and not allowed("api.example.evil:443", ("api.example",))
    assert allowed("[::1]:8000", ("localhost", "127.0.0.1", "::1")) and allowed("anything", ("*",))
    assert not allowed(None, ("localhost",)) and allowed(None, None)


def test_cli_allowed_hosts_is_checked():
    from typer.testing import CliRunner

    from leaplm.cli import app

    r = CliRunner().invoke(app, ["serve", "--allowed-hosts", "a b", "--port", "1"])
    assert r.exit_code == 2 and "--allowed-hosts" in r.output

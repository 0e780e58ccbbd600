"""Raw TCP clients: what a broken or hostile client sends, byte for byte."""
from __future__ import annotations

import json
import socket
import time


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    host, port = url.rsplit("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    return s


def exchange(url: str, raw: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes (or the timeout), return what came back."""
    s = connect(url, timeout)
    try:
        s.sendall(raw)
        return read_all(s, timeout)
    finally:
        s.close()


def read_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except socket.timeout:
        pass
    return out


def closed_within(s: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed the socket (recv returns b'' or reset), None if still open after `seconds`."""
    t = time.monotonic()
    s.settimeout(seconds)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return time.monotonic() - t
    except socket.timeout:
        return None
    except (ConnectionResetError, BrokenPipeError):
        return time.monotonic() - t


def parse(raw: bytes) -> tuple[int, dict, bytes]:
    """(status, headers lower-cased, body) of the first response in raw."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        body = out
    return status, headers, body


def openai_error(body: bytes) -> dict:
    """The error object of an OpenAI-shaped error body (fails the test if the shape is not that)."""
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["code"], str) and err["code"], err
    return err

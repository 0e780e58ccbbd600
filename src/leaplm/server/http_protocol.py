"""uvicorn's HTTP protocols with two guards the stock ones lack, and uvicorn's configuration for leaplm.

- A request read deadline: from the moment the server waits for a request (connection opened, or the previous
  response sent) the client has `request_read_timeout_s` to deliver the whole request, headers and body. A
  client that sends nothing, or dribbles a byte at a time (slowloris), gets a 408 and the socket is closed;
  uvicorn's own keep-alive timer is reset by every byte, so it alone cannot stop a trickle.
- Malformed HTTP (a bad request line or header, conflicting lengths, a broken chunk, a request line and headers
  over MAX_HEAD_BYTES) is answered with a 400 in OpenAI's error shape, not uvicorn's plain text.

Two parsers carry them: httptools (llhttp, in C; uvicorn's own choice when it is installed), whose chunked
framing of a streamed response is one bytes formatting per chunk, and h11 (pure Python), whose framing runs
through its state machine in Python for every chunk. ServerConfig.http_parser chooses ("auto": httptools when
installed, else h11); uvicorn is always given the class itself, never its "auto".
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import ServerConfig
from .protocol import error_body

log = logging.getLogger(__name__)


def _error_bytes(message: str, code: str) -> bytes:
    return json.dumps(error_body(message, "invalid_request_error", None, code)).encode()


MAX_HEAD_BYTES = 16 << 10        # request line + headers (h11's default limit, enforced on httptools too)


class ReadDeadline:
    """The read deadline and the OpenAI-shaped error responses, for a uvicorn HTTP protocol (mixed in first)."""
    read_timeout_s: float = 10.0         # set per server by protocol_class()

    def _arm_read_deadline(self) -> None:
        self._disarm_read_deadline()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm_read_deadline(self) -> None:
        handle = getattr(self, "_read_deadline", None)
        if handle is not None:
            handle.cancel()
            self._read_deadline = None

    def _time_out(self, started: bool) -> None:
        """The deadline passed while waiting for a request: a 408 when part of one came (and no response to it
        began), then the socket closed."""
        if started and (self.cycle is None or not self.cycle.response_started or self.cycle.response_complete):
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True          # the app's later sends are dropped, its receive() ends
                self.cycle.message_event.set()
            self._write_error(408, "Request Timeout",
                              f"the request was not received within {self.read_timeout_s:g} s", "request_timeout")
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._write_error(400, "Bad Request", f"malformed HTTP request: {msg}", "invalid_http")
        self.transport.close()

    def _write_error(self, status: int, reason: str, message: str, code: str) -> None:
        """One complete response, framed here: the parser's state machine may already be in its error state."""
        body = _error_bytes(message, code)
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        self.transport.write(head + body)


class GuardedH11Protocol(ReadDeadline, H11Protocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm_read_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):   # the request is in (or the connection is done)
            self._disarm_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read_deadline()        # waiting for the next request on this connection

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        started = self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]
        if started and self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            started = False                  # a response is under way: no 408 in its middle, only the close
        self._time_out(bool(started))


def httptools_installed() -> bool:
    return importlib.util.find_spec("httptools") is not None


def protocol_class(config: ServerConfig) -> type:
    """The guarded protocol of config.http_parser ("auto": httptools when installed, else h11), its read timeout
    set."""
    parser = config.http_parser
    if parser == "auto":
        parser = "httptools" if httptools_installed() else "h11"
    if parser == "httptools":
        from .http_httptools import GuardedHttpToolsProtocol as base
    else:
        base = GuardedH11Protocol
    return type(f"Leaplm{base.__name__}", (base,), {"read_timeout_s": config.request_read_timeout_s})


def uvicorn_config(app, config: ServerConfig) -> uvicorn.Config:
    """The uvicorn settings of every leaplm server (`leaplm serve` and the tests' in-process server).
    The loop is asyncio even when uvloop is installed (ray[serve] brings it): the signal handling and timeouts are
    tested on asyncio's loop."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=5, lifespan="on", http=protocol_class(config), loop="asyncio",
                          timeout_keep_alive=config.keep_alive_timeout_s, h11_max_incomplete_event_size=MAX_HEAD_BYTES)

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
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import ServerConfig
from .http_guards import MAX_HEAD_BYTES, ReadDeadline

log = logging.getLogger(__name__)


class GuardedH11Protocol(ReadDeadline, H11Protocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm_read_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):   # the request is in (or the connection is done)
            self._disarm_read_deadline()

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

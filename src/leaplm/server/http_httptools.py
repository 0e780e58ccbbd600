"""uvicorn's httptools protocol with leaplm's guards (http_protocol.py: the read deadline, OpenAI-shaped 400s and
408s: http_guards.py), and the bound h11 sets on a request's head that llhttp does not: a request line and headers still
incomplete after MAX_HEAD_BYTES is a 400, not headers buffered without end (a head that arrives whole is parsed
whatever its length, as h11 does).

Imported only when httptools is installed (http_protocol.protocol_class)."""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .http_guards import MAX_HEAD_BYTES, ReadDeadline


class GuardedHttpToolsProtocol(ReadDeadline, HttpToolsProtocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._partial = False              # bytes of a request not yet whole have come since the deadline was armed
        self._in_head = True               # the next bytes belong to a request's line and headers
        self._head_bytes = 0               # bytes received while in them
        self._arm_read_deadline()

    def data_received(self, data: bytes) -> None:
        if data:
            self._partial = True           # on_message_complete (called while feeding) clears it again
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self.send_400_response(f"request line and headers over {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._partial = False
        self._in_head, self._head_bytes = True, 0
        self._disarm_read_deadline()       # the request is in

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if not self._partial and (self.pipeline or (self.cycle is not None and not self.cycle.response_complete)):
            return                         # a response is under way: on_response_complete arms the next deadline
        self._time_out(self._partial)

"""What both guarded HTTP protocols share (http_protocol.py: h11; http_httptools.py: httptools): the request read
deadline's 408 and the OpenAI-shaped 400 for malformed HTTP, written straight to the transport."""
from __future__ import annotations

import json

from .protocol import error_body


def _error_bytes(message: str, code: str) -> bytes:
    return json.dumps(error_body(message, "invalid_request_error", None, code)).encode()


MAX_HEAD_BYTES = 16 << 10        # a request line and headers still incomplete past this: 400 (h11 default; httptools too)


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

    def connection_lost(self, exc) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read_deadline()      # waiting for the next request on this connection

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

"""The ASGI guard in front of every route: the Host check (DNS rebinding), the API key, the body size limit, the
answer to a body refused before, and request counting by endpoint and status."""
from __future__ import annotations

import asyncio
import hashlib
import hmac

from . import hosts
from .body import OFF_LOOP_BYTES
from .errors import json_error
from .hosts import default_allowed_hosts
from .protocol import APIError
from .state import ServerState


class RequestGuard:
    """ASGI middleware before any route: request counting by status, API key (constant-time compare) on /v1/*,
    and the body size limit (413) — a body is read whole (up to the limit) and replayed to the app.

    Refused bodies are remembered: a body sent to a completions route that got a 400 before it ran (validation,
    planning, a grammar llguidance refuses, admission's never-fits) gets the same 400 again, byte for byte, from a
    digest of the route, the Content-Type and the raw bytes (blake2b, in C, a quarter of a millisecond for 270 KB),
    without being parsed, validated or planned again. Those 400s depend on the body and the server's settings
    alone; a 400 given after the request ran (its grammar failing while generating, which may depend on what was
    sampled) is not kept. The last `state.refused.size` such bodies are kept (state.py)."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json")
    REMEMBERED = ("/v1/completions", "/v1/chat/completions")     # routes whose refusals are remembered
    MAX_REMEMBERED_BYTES = 64 << 10                               # a longer 400 is not kept

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        key = state.config.api_key
        self.expected = key.encode() if key else None
        cfg = state.config
        self.allowed_hosts = cfg.allowed_hosts if cfg.allowed_hosts is not None else default_allowed_hosts(cfg.host)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.ENDPOINTS else "other"
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            err = self._check_host(scope)
            if err is None:
                err = self._check_auth(scope)
            body = None
            if err is None and scope["method"] in ("POST", "PUT", "PATCH"):
                err, body, receive = await self._buffer_body(scope, receive)
            if err is not None:
                await json_error(err)(scope, receive, send_status)
                return
            key = await self._refusal_key(scope, body)
            if key is None:
                await self.app(scope, receive, send_status)
                return
            refused = self.state.refused.get(key)
            if refused is not None:
                self.state.metrics.refusals_repeated.inc()
                for message in refused:
                    await send_status(message)
                return
            answer: list[dict] = []

            async def send_kept(message):
                if (answer or message.get("status") == 400) and len(answer) < 3:   # a 400's start and body
                    answer.append(message)
                await send_status(message)

            await self.app(scope, receive, send_kept)
            if status[0] == 400 and not (scope.get("state") or {}).get("ran"):
                self._remember(key, answer)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status[0])).inc()

    async def _refusal_key(self, scope, body: bytes | None) -> bytes | None:
        """The digest a refusal of this request is remembered by; None for requests whose refusals are not (other
        routes, a body cut short, a server not serving: a 503 comes before a 400 the body would get). A large
        body's digest is computed in the body pool (body.py), off the event loop."""
        state = self.state
        if body is None or scope["path"] not in self.REMEMBERED or not state.ready or state.draining:
            return None
        content_type = b""
        for name, value in scope.get("headers", []):
            if name == b"content-type":          # how the body is read (FastAPI parses only JSON types)
                content_type = value
                break
        head = scope["path"].encode() + b"\0" + content_type + b"\0"        # no NUL in either
        if len(body) >= OFF_LOOP_BYTES:
            return await asyncio.get_running_loop().run_in_executor(state.body_pool, _digest, head, body)
        return _digest(head, body)

    def _remember(self, key: bytes, answer: list[dict]) -> None:
        """Keep a 400 sent whole (its start and one last body message) and not too long."""
        if len(answer) != 2 or answer[1]["type"] != "http.response.body" or answer[1].get("more_body", False):
            return
        if len(answer[1].get("body", b"")) > self.MAX_REMEMBERED_BYTES:
            return
        self.state.refused.put(key, tuple(answer))

    def _check_host(self, scope) -> APIError | None:
        """DNS rebinding: only the names this server is meant to be reached by (see hosts.py)."""
        if self.allowed_hosts is None:
            return None
        value = None
        for name, v in scope.get("headers", []):
            if name == b"host":
                value = v.decode("latin-1")
                break
        if hosts.allowed(value, self.allowed_hosts):
            return None
        return APIError(400, f"Host header {value!r} is not one this server answers (allowed: "
                             f"{', '.join(self.allowed_hosts)}; see --allowed-hosts)", None, "invalid_host")

    def _check_auth(self, scope) -> APIError | None:
        if self.expected is None or not scope["path"].startswith("/v1/"):
            return None
        got = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                got = value
                break
        scheme, _, token = got.partition(b" ")       # the scheme is case-insensitive (RFC 7235)
        if scheme.lower() != b"bearer":
            token = b""
        if not hmac.compare_digest(token, self.expected):
            return APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", None,
                            "invalid_api_key")
        return None

    async def _buffer_body(self, scope, receive):
        """(error or None, the whole body or None when the client went away first, the receive to hand on)."""
        limit = self.state.config.max_body_bytes
        too_big = APIError(413, f"request body exceeds {limit} bytes", None, "request_too_large")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > limit:
                        return too_big, None, receive
                except ValueError:
                    return APIError(400, "invalid Content-Length header", None, "invalid_request"), None, receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None, _replay(b"", receive, disconnected=True)
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return too_big, None, receive
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        return None, body, _replay(body, receive)


def _digest(head: bytes, body: bytes) -> bytes:
    h = hashlib.blake2b(head, digest_size=16)
    h.update(body)
    return h.digest()


def _replay(body: bytes, receive, disconnected: bool = False):
    sent = False

    async def replay():
        nonlocal sent
        if disconnected:
            return {"type": "http.disconnect"}
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()          # after the body: blocks until the client disconnects

    return replay

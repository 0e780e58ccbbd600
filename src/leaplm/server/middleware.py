"""The ASGI guard in front of every route: the Host check (DNS rebinding), the API key, the body size limit, and
request counting by endpoint and status."""
from __future__ import annotations

import hmac

from . import hosts
from .errors import json_error
from .hosts import default_allowed_hosts
from .protocol import APIError
from .state import ServerState


class RequestGuard:
    """ASGI middleware before any route: request counting by status, API key (constant-time compare) on /v1/*,
    and the body size limit (413) — a body is read whole (up to the limit) and replayed to the app."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json")

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
            if err is None and scope["method"] in ("POST", "PUT", "PATCH"):
                err, receive = await self._buffer_body(scope, receive)
            if err is not None:
                await json_error(err)(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status[0])).inc()

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
        limit = self.state.config.max_body_bytes
        too_big = APIError(413, f"request body exceeds {limit} bytes", None, "request_too_large")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > limit:
                        return too_big, receive
                except ValueError:
                    return APIError(400, "invalid Content-Length header", None, "invalid_request"), receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, _replay(b"", receive, disconnected=True)
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return too_big, receive
            chunks.append(body)
            if not message.get("more_body", False):
                break
        return None, _replay(b"".join(chunks), receive)


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

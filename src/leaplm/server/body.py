"""Request bodies decoded off the event loop when they are large.

FastAPI decodes a route's JSON body with `await request.json()` on the event loop: 1-2 ms for a 200 KB body
(a hostile schema, 10,000 choices), during which no stream gets its tokens written and no request is read. A
route of class BodyRoute hands its handler a BodyRequest, whose json() decodes a body of OFF_LOOP_BYTES or more
in the server's body pool (one thread: large bodies wait for each other there, not on the loop) and a smaller one
in place, where a thread hop would cost more than the decode. The decoded value, and every error (invalid JSON,
a body that is not UTF-8), are exactly those of the decode on the loop: the same function runs either way."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi import Request
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 32 << 10        # bodies at least this long are decoded in the body pool


def decode_json(body: bytes) -> Any:
    """What Starlette's Request.json() computes (json.loads of the raw bytes)."""
    return json.loads(body)


class BodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) >= OFF_LOOP_BYTES:
                state = self.app.state.leaplm
                state.metrics.bodies_off_loop.inc()
                self._json = await asyncio.get_running_loop().run_in_executor(state.body_pool, decode_json, body)
            else:
                self._json = decode_json(body)
        return self._json


class BodyRoute(APIRoute):
    """An APIRoute whose handler reads its body through BodyRequest."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request):
            return await handler(BodyRequest(request.scope, request.receive))

        return route

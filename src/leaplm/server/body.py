"""Request bodies decoded and validated off the event loop when they are large.

FastAPI decodes a route's JSON body with `await request.json()` and validates it against the route's model, both
on the event loop: for a 175 KB hostile body (10,000 choices, a schema of 2,000 alternatives) 1.3 ms of decoding
and 2 ms of validation (the lone-surrogate check), during which no stream gets its tokens written and no request
is read. A route of class BodyRoute hands its handler a BodyRequest, whose json() runs both for a body of
OFF_LOOP_BYTES or more in the server's body pool (one thread: large bodies wait for each other there, not on the
loop), and returns what FastAPI then takes as it is: the validated model (a model instance passes FastAPI's own
validation unchanged), or, when validation fails, the decoded JSON, validated again by FastAPI on the loop so that
its errors are exactly FastAPI's (a refused body is answered from middleware.py's memory when sent again). A
smaller body is decoded in place, where a thread hop would cost more than the work. Errors are those of the decode
on the loop: the same function runs either way. (The digest middleware.py keeps refusals by is computed in the
same pool for a body of OFF_LOOP_BYTES or more.)

The routes of this class take their body as one model (`body: CompletionRequest`), not embedded in an object."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi import Request
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 32 << 10        # bodies at least this long are decoded and validated in the body pool


def decode_json(body: bytes) -> Any:
    """What Starlette's Request.json() computes (json.loads of the raw bytes)."""
    return json.loads(body)


def decode_and_validate(body: bytes, field) -> Any:
    """The body's model when it validates against `field` (FastAPI's ModelField of the route's body), else its
    JSON as decoded (FastAPI validates it again and answers its errors)."""
    value = decode_json(body)
    if field is None:
        return value
    model, errors = field.validate(value, {}, loc=("body",))
    return value if errors else model


class BodyRequest(Request):
    body_field = None            # the route's body (set by BodyRoute)

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) >= OFF_LOOP_BYTES:
                state = self.app.state.leaplm
                state.metrics.bodies_off_loop.inc()
                self._json = await asyncio.get_running_loop().run_in_executor(
                    state.body_pool, decode_and_validate, body, self.body_field)
            else:
                self._json = decode_json(body)
        return self._json


class BodyRoute(APIRoute):
    """An APIRoute whose handler reads its body through BodyRequest."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        field = self.body_field

        async def route(request: Request):
            request = BodyRequest(request.scope, request.receive)
            request.body_field = field
            return await handler(request)

        return route

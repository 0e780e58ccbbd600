"""An ASGI middleware that names the replica serving each HTTP response (`x-leaplm-replica`), streamed ones
included: the header is added to the response-start message, before any body is sent."""
from __future__ import annotations

HEADER = b"x-leaplm-replica"


class ReplicaHeader:
    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, self.replica)]}
            await send(message)

        return await self.app(scope, receive, send_named)

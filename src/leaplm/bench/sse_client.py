"""The benchmarks' client for streamed responses: HTTP/1.1 over asyncio's streams, one connection per request, the
SSE events split from the raw bytes.

Every `leaplm bench serve` figure comes from a client on the same machine as the server, so whatever CPU the
client takes per streamed chunk is taken from the server beside it. httpx (httpcore, h11, anyio) takes several
times the CPU per chunk that this client does (the figures are in docs/serving.md); a real client runs on another
machine, and the less this one takes, the closer a figure is to what that client sees.

Responses are read as the server writes them: chunked transfer encoding (streams) or a Content-Length body
(errors, JSON answers); anything else is read to the end of the connection."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from urllib.parse import urlsplit


class StreamedResponse:
    """One response: its status, then its body as raw bytes (`body`) or as SSE messages (`messages`)."""

    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str]):
        self.reader, self.status, self.headers = reader, status, headers
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()

    async def pieces(self):
        """The body as it arrives: one piece per HTTP chunk (chunked), else the whole body."""
        if not self.chunked:
            length = self.headers.get("content-length")
            yield await (self.reader.readexactly(int(length)) if length is not None else self.reader.read())
            return
        while True:
            line = await self.reader.readuntil(b"\r\n")
            size = int(line.split(b";", 1)[0], 16)        # chunk extensions, if any, are ignored
            if size == 0:
                return
            data = await self.reader.readexactly(size + 2)  # the chunk and its CRLF
            yield data[:-2]

    async def body(self) -> bytes:
        return b"".join([p async for p in self.pieces()])

    async def messages(self):
        """The JSON message of each `data:` event, up to `data: [DONE]`. An event may span HTTP chunks and a
        chunk may hold several events: events end at a blank line, whatever the chunking."""
        buf = b""
        async for piece in self.pieces():
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if ev == b"data: [DONE]":
                    return
                if ev.startswith(b"data: "):
                    yield json.loads(ev[6:])


@asynccontextmanager
async def post(url: str, path: str, body: dict):
    """POST body as JSON to url + path; yields the StreamedResponse once its head is in."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (path.encode(), host.encode(), port, len(payload), payload))
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        yield StreamedResponse(reader, status, headers)
    finally:
        writer.close()

"""The benchmarks' streaming client (bench/sse_client.py) against a socket server that frames its answers by hand:
events split across HTTP chunks and several in one, a Content-Length error body, and the request it sends."""
from __future__ import annotations

import asyncio
import json

from leaplm.bench import sse_client

EVENTS = [{"id": "a", "choices": [{"text": "x\n\ny"}]}, {"id": "b", "usage": {"completion_tokens": 2}},
          {"id": "c", "choices": [], "usage": None}]


def _chunked(pieces: list[bytes]) -> bytes:
    out = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) if i == 0 else b"%x\r\n%s\r\n" % (len(p), p)
                   for i, p in enumerate(pieces))
    return out + b"0\r\n\r\n"


async def _serve_once(answer: bytes, seen: list):
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length")))
        seen.append((head, await reader.readexactly(length)))
        for i in range(0, len(answer), 7):          # dribbled: the client must not depend on how reads split
            writer.write(answer[i:i + 7])
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _run(answer: bytes, consume):
    async def go():
        seen: list = []
        server = await _serve_once(answer, seen)
        port = server.sockets[0].getsockname()[1]
        async with server:
            async with sse_client.post(f"http://127.0.0.1:{port}", "/v1/completions", {"prompt": "hi"}) as r:
                got = await consume(r)
        return seen, got
    return asyncio.run(go())


def test_events_are_whole_whatever_the_chunking():
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in EVENTS) + b": comment\n\n" + \
        b"data: [DONE]\n\n"
    cuts = [0, 5, 9, 60, 61, len(stream) - 3, len(stream)]          # mid-prefix, mid-JSON, mid-terminator
    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" +
              _chunked([stream[a:b] for a, b in zip(cuts, cuts[1:])]))

    async def consume(r):
        return r.status, [m async for m in r.messages()]

    seen, (status, messages) = _run(answer, consume)
    assert status == 200 and messages == EVENTS
    head, body = seen[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and json.loads(body) == {"prompt": "hi"}


def test_a_content_length_answer_is_read_whole():
    err = json.dumps({"error": {"message": "server busy", "code": "queue_full"}}).encode()
    answer = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\nRetry-After: 1\r\n\r\n%s" % (len(err), err)

    async def consume(r):
        return r.status, r.headers["retry-after"], await r.body()

    _, (status, retry, body) = _run(answer, consume)
    assert (status, retry) == (429, "1") and json.loads(body)["error"]["code"] == "queue_full"

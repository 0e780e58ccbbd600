"""The server's stream interval (ServerConfig.stream_interval_ms, server/handoff.py): tokens held for a while go
out together in one write, as the same chunks a server without an interval sends one step at a time; the first
token and the last are never held."""
from __future__ import annotations

import asyncio
import json

import pytest

from leaplm.bench import sse_client
from serverkit import InProcessServer

BODY = {"model": "tiny", "prompt": "the quick brown", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CHAT = {**{k: v for k, v in BODY.items() if k != "prompt"}, "messages": [{"role": "user", "content": "the quick"}]}


async def _pieces(url: str, path: str, body: dict) -> list[bytes]:
    """The response body as the server wrote it: one piece per HTTP chunk."""
    async with sse_client.post(url, path, body) as r:
        assert r.status == 200, await r.body()
        return [p async for p in r.pieces()]


def _messages(pieces: list[bytes]) -> list[dict]:
    return [json.loads(ev[6:]) for ev in b"".join(pieces).split(b"\n\n")
            if ev.startswith(b"data: ") and ev != b"data: [DONE]"]


def _tokens(messages: list[dict]) -> int:
    return sum(len(m["choices"][0].get("token_ids") or []) for m in messages if m["choices"])


@pytest.fixture(scope="module")
def servers(tiny_pair):
    """The same target served without an interval and with the longest (a forward takes well under 1 ms here)."""
    out = {}
    try:
        for ms in (0.0, 1000.0):
            out[ms] = InProcessServer(tiny_pair[0], None, method="none", api_key=None, stream_interval_ms=ms)
        for srv in out.values():
            srv.wait_ready()
        yield out
    finally:
        for srv in out.values():
            srv.stop()


@pytest.mark.parametrize("path,body", [("/v1/completions", BODY), ("/v1/chat/completions", CHAT)])
def test_held_tokens_are_the_same_chunks_in_fewer_writes(servers, path, body):
    every = _messages(asyncio.run(_pieces(servers[0.0].url, path, body)))
    pieces = asyncio.run(_pieces(servers[1000.0].url, path, body))
    held = _messages(pieces)
    strip = lambda ms: [{k: v for k, v in m.items() if k not in ("id", "created")} for m in ms]   # noqa: E731
    assert strip(held) == strip(every)                # chunk for chunk, the usage so far on each included
    assert _tokens(every) == 40 and len(every) >= 40
    assert len(pieces) < len(held) / 2                # several steps' chunks per write


def test_the_first_token_is_not_held(servers):
    """The first token goes out when it is produced, not with the tokens after it."""
    pieces = asyncio.run(_pieces(servers[1000.0].url, "/v1/completions", {**BODY, "max_tokens": 200}))
    first = _messages(pieces[:1])
    assert _tokens(first) >= 1 and _tokens(first) < 200 == _tokens(_messages(pieces))

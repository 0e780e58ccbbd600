"""Signals under load on a real `leaplm serve` process: SIGTERM drains, a second signal during the drain stops
at once but cleanly (every client gets a well-formed end: a finished stream, or an error event then [DONE];
never a plain-text 500 or a cut connection), and the process exits 0, never by SIGABRT. On the tiny checkpoints,
and on the tiny pair as GGUF files through both native paths (the int8 kernel, libllama) with speculation."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from gguf_servers import BACKENDS, cli_args, skip_unless_available, write_gguf_pair
from serverkit import API_KEY, MODEL, ServerProcess

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
        "stream": True}


async def _stream(h: httpx.AsyncClient, body: dict) -> dict:
    """What one client saw: status, content type, SSE data lines, and how the connection ended."""
    seen = {"status": None, "ctype": None, "data": [], "raw": b"", "error": None}
    try:
        async with h.stream("POST", "/v1/completions", json=body) as r:
            seen["status"], seen["ctype"] = r.status_code, r.headers.get("content-type", "")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen["data"].append(line[6:])
                elif line.strip():
                    seen["raw"] += line.encode()
    except httpx.HTTPError as e:
        seen["error"] = f"{type(e).__name__}: {e}"
    return seen


def _check_clean_end(seen: dict) -> str:
    """'finished', 'aborted' (error event + [DONE]), or 'refused' (a JSON 503): anything else fails."""
    assert seen["error"] is None, f"connection broke: {seen['error']}"
    if seen["status"] != 200:
        assert seen["status"] == 503 and "json" in seen["ctype"], seen
        return "refused"
    assert seen["data"] and seen["data"][-1] == "[DONE]", seen["data"][-3:]
    chunks = [json.loads(d) for d in seen["data"][:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        assert len(errors) == 1 and "error" in chunks[-1] and errors[0]["code"] == "shutting_down", errors
        return "aborted"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "finished"


async def _load_then_signals(srv: ServerProcess, n: int, signals: list[float]) -> list[dict]:
    """n streaming requests running, then a SIGTERM at each of the given delays (seconds after the first)."""
    async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60) as h:
        tasks = [asyncio.create_task(_stream(h, LONG)) for _ in range(n)]
        for _ in range(1000):
            text = (await h.get("/metrics")).text
            if f"leaplm_running_requests {float(min(n, 4))}" in text:
                break
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        for delay in signals:
            await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
            srv.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)


@pytest.mark.parametrize("gap", [0.0, 0.05, 0.3])
def test_second_sigterm_during_drain_exits_cleanly(tiny_pair, gap):
    _second_sigterm(ServerProcess(*tiny_pair, "--drain-timeout", "60", "--max-batch", "4", "--method", "none"), gap)


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    return write_gguf_pair(tmp_path_factory.mktemp("signals_pair"))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_second_sigterm_on_gguf_exits_cleanly(gguf_pair, backend):
    """The same on each native path, speculating with the draft model: the C++ layer loop or libllama's contexts
    torn down mid-step by the second signal end the process with 0, not SIGABRT."""
    skip_unless_available(backend)
    _second_sigterm(ServerProcess(*gguf_pair, "--drain-timeout", "60", "--max-batch", "4", "--k", "4", "--method",
                                  "draft", *cli_args(backend)), 0.05)


def _second_sigterm(srv: ServerProcess, gap: float) -> None:
    try:
        srv.wait_ready()
        seen = asyncio.run(_load_then_signals(srv, 6, [0.0, 0.1 + gap]))
        code = srv.proc.wait(30)
        ends = [_check_clean_end(s) for s in seen]
        log = srv.log_path.read_text()
        assert code == 0, f"exit {code}: {log[-2000:]}"
        assert "terminate called" not in log and "Traceback" not in log, log[-2000:]
        assert "aborted" in ends                         # the second signal did not wait for 1000 tokens
    finally:
        srv.stop()


def test_sigterm_drain_under_load_finishes_every_request(tiny_pair, figures):
    """One SIGTERM with 6 requests in (4 running, 2 waiting): all 6 finish, the drain time is reported."""
    srv = ServerProcess(*tiny_pair, "--drain-timeout", "60", "--max-batch", "4", "--method", "none")
    try:
        srv.wait_ready()
        body = dict(LONG, max_tokens=200)

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60) as h:
                tasks = [asyncio.create_task(_stream(h, body)) for _ in range(6)]
                for _ in range(1000):
                    if "leaplm_queue_depth 2.0" in (await h.get("/metrics")).text:
                        break
                    await asyncio.sleep(0.02)
                t = time.monotonic()
                srv.proc.send_signal(signal.SIGTERM)
                seen = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                return seen, t

        seen, t = asyncio.run(main())
        code = srv.proc.wait(30)
        drain_s = time.monotonic() - t
        assert code == 0
        assert [_check_clean_end(s) for s in seen] == ["finished"] * 6
        figures.update(requests=6, tokens_each=200, drain_s=round(drain_s, 2))
    finally:
        srv.stop()

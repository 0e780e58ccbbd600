"""The event loop stays responsive: a 4 MB prompt (under the body limit) is refused without freezing /health or
the other streams (a character-count check before tokenizing; tokenizing runs off the loop)."""
from __future__ import annotations

import asyncio
import time

import httpx

import rawhttp
from serverkit import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def _health_gaps(h: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    out = []
    while not stop.is_set():
        t = time.perf_counter()
        r = await h.get("/health")
        assert r.status_code == 200
        out.append(time.perf_counter() - t)
        await asyncio.sleep(0.005)
    return out


def _run(server, bodies: list[dict]) -> tuple[list[float], list[float], list[httpx.Response]]:
    async def main():
        limits = httpx.Limits(max_connections=20)
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=60, limits=limits) as h:
            stop = asyncio.Event()
            calm = asyncio.create_task(_health_gaps(h, stop))
            await asyncio.sleep(0.5)
            stop.set()
            baseline = await calm
            stop = asyncio.Event()
            probe = asyncio.create_task(_health_gaps(h, stop))
            await asyncio.sleep(0.05)
            rs = await asyncio.gather(*[h.post("/v1/completions", json=b) for b in bodies])
            await asyncio.sleep(0.05)
            stop.set()
            return baseline, await probe, rs

    return asyncio.run(main())


def _tokenize_s(server, text: str) -> float:
    """Seconds the server's tokenizer takes for text here and now: what a loop that tokenized it would freeze for
    (measured rather than assumed, so the bound holds on a loaded machine as on an idle one)."""
    tok = server.state.scheduler.engine.tokenizer
    t = time.perf_counter()
    tok(text)
    return time.perf_counter() - t


def test_4mb_prompt_does_not_block_health(server):
    big = "the quick brown fox " * 200_000                     # 4,000,000 characters
    baseline, during, (r,) = _run(server, [{"model": MODEL, "prompt": big, "max_tokens": 4}])
    assert r.status_code == 400, r.text[:300]
    err = rawhttp.openai_error(r.content)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    # tokenizing it on the loop would freeze /health for 20x the time a 20th of it takes (tokenizing is linear)
    slice_s = _tokenize_s(server, big[: len(big) // 20])
    worst = max(during)
    assert worst < max(baseline) + slice_s, f"/health took {worst * 1000:.0f} ms while the prompt was refused " \
                                            f"(a 20th of it tokenizes in {slice_s * 1000:.0f} ms)"


def test_long_prompts_under_the_character_limit_tokenize_off_the_loop(server):
    """Prompts just under what the character check lets through are tokenized (then refused for their token
    count): 8 of them at once still leave /health within 100 ms of its calm latency."""
    from leaplm.server.state import max_prompt_chars

    limit = max_prompt_chars(server.state)
    text = ("größer über Straße 東京 " * (limit // 20 + 1))[: limit - 1]
    bodies = [{"model": MODEL, "prompt": text, "max_tokens": 4} for _ in range(8)]
    baseline, during, rs = _run(server, bodies)
    assert all(r.status_code == 400 for r in rs)
    assert all(rawhttp.openai_error(r.content)["code"] == "context_length_exceeded" for r in rs)
    assert max(during) < max(baseline) + 0.1, f"/health took {max(during) * 1000:.0f} ms"

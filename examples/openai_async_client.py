"""An async streaming client for `leaplm serve` (or any OpenAI-compatible server) with the official `openai`
package: per-request timeouts, retries with backoff, and cancellation that frees the server's batch row.

    leaplm serve --port 8000 &
    python examples/openai_async_client.py --base-url http://127.0.0.1:8000/v1 \
        --prompt "def fib(n):" --prompt "class Stack:" --max-tokens 48

What each part does:
- Timeouts: `httpx`-level (connect/read) through the client's `timeout`, plus a whole-request deadline with
  asyncio.timeout, because a stream that keeps sending tokens slowly never trips a read timeout.
- Retries: only before the first token arrives (connection errors, 408/409/429/5xx, timeouts); a stream that
  already printed text is not replayed, or the reader would see it twice. 429 and 503 carry Retry-After, which
  the backoff honours. The client's own max_retries is 0 so that there is exactly one retry policy.
- Cancellation: cancelling the task (Ctrl-C, a deadline, --cancel-after) leaves the `async with` block, which
  closes the HTTP stream; leaplm notices the disconnect and aborts the request at its next step.
- leaplm reports speculation figures in the final usage chunk (`usage.speculative`) when asked with
  stream_options.include_usage.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import openai
from openai import AsyncOpenAI

RETRYABLE = (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError, openai.InternalServerError,
             asyncio.TimeoutError)


@dataclass
class StreamResult:
    prompt: str
    text: str = ""
    tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    attempts: int = 0
    finish_reason: str | None = None
    speculative: dict | None = None       # leaplm's usage extension: draft_tokens, accepted_tokens, ...
    error: str | None = None
    chunks: list[str] = field(default_factory=list)


def retry_delay(error: Exception, attempt: int, base_s: float = 0.5, cap_s: float = 8.0) -> float:
    """Exponential backoff with jitter; a server's Retry-After (429, 503) wins when it is longer."""
    delay = min(cap_s, base_s * 2 ** attempt) * (0.5 + random.random() / 2)
    response = getattr(error, "response", None)
    if response is not None:
        try:
            delay = max(delay, float(response.headers.get("retry-after", 0)))
        except ValueError:
            pass
    return delay


async def stream_completion(client: AsyncOpenAI, model: str, prompt: str, *, max_tokens: int = 64,
                            temperature: float = 0.0, deadline_s: float = 60.0, retries: int = 3,
                            on_text=None) -> StreamResult:
    """Stream one completion; retried only until its first token, bounded by deadline_s overall."""
    res = StreamResult(prompt)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s):
            for attempt in range(retries + 1):
                res.attempts = attempt + 1
                try:
                    stream = await client.completions.create(
                        model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
                        stream_options={"include_usage": True})
                    async with stream:                     # leaving the block closes the HTTP stream
                        async for chunk in stream:
                            # chunks already buffered are read without yielding to the event loop, where the
                            # timeout's cancellation is delivered: a slow reader checks the deadline itself
                            if time.perf_counter() - t0 > deadline_s:
                                raise TimeoutError
                            if chunk.choices:
                                piece = chunk.choices[0].text
                                if piece:
                                    if res.ttft_s is None:
                                        res.ttft_s = time.perf_counter() - t0
                                    res.text += piece
                                    res.chunks.append(piece)
                                    if on_text is not None:
                                        on_text(prompt, piece)
                                res.finish_reason = chunk.choices[0].finish_reason or res.finish_reason
                            if chunk.usage is not None:
                                res.tokens = chunk.usage.completion_tokens
                                res.speculative = (chunk.usage.model_extra or {}).get("speculative")
                    break
                except RETRYABLE as e:
                    if res.text or attempt == retries:     # never replay a stream the caller has seen
                        raise
                    await asyncio.sleep(retry_delay(e, attempt))
    except (TimeoutError, asyncio.TimeoutError):
        res.error = f"deadline of {deadline_s} s exceeded"
    except openai.APIStatusError as e:
        res.error = f"HTTP {e.status_code}: {e.message}"
    except openai.APIError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.total_s = time.perf_counter() - t0
    return res


def make_client(base_url: str, api_key: str, connect_s: float = 5.0, read_s: float = 30.0) -> AsyncOpenAI:
    timeout = httpx.Timeout(read_s, connect=connect_s)
    return AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)


async def run(args) -> list[StreamResult]:
    client = make_client(args.base_url, args.api_key, read_s=args.read_timeout)
    limit = asyncio.Semaphore(args.concurrency)

    async def one(prompt: str) -> StreamResult:
        async with limit:
            return await stream_completion(client, args.model, prompt, max_tokens=args.max_tokens,
                                           temperature=args.temperature, deadline_s=args.deadline,
                                           retries=args.retries)

    tasks = [asyncio.create_task(one(p)) for p in args.prompt]
    if args.cancel_after is not None:                      # show cancellation: stop whatever is still running
        done, pending = await asyncio.wait(tasks, timeout=args.cancel_after)
        for t in pending:
            t.cancel()
    results = []
    for p, t in zip(args.prompt, tasks):
        try:
            results.append(await t)
        except asyncio.CancelledError:
            results.append(StreamResult(p, error="cancelled"))
    await client.close()
    return results


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default="leaplm-embedded")
    ap.add_argument("--prompt", action="append", help="repeatable")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--read-timeout", type=float, default=30.0, help="seconds without a byte from the server")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds for a whole request, retries included")
    ap.add_argument("--cancel-after", type=float, default=None, help="cancel requests still running after this")
    args = ap.parse_args(argv)
    args.prompt = args.prompt or ["def fib(n):"]
    return args


def main(argv=None) -> int:
    results = asyncio.run(run(parse_args(argv)))
    for r in results:
        spec = r.speculative or {}
        ttft = f"{1000 * r.ttft_s:.0f} ms" if r.ttft_s is not None else "-"
        print(f"--- {r.prompt!r}: {r.tokens} tokens, TTFT {ttft}, {r.total_s:.2f} s, attempts {r.attempts}"
              + (f", acceptance {spec.get('acceptance_rate', 0):.2f}" if spec else "")
              + (f", error: {r.error}" if r.error else ""))
        print(r.text)
    return 1 if any(r.error and r.error != "cancelled" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

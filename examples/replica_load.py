"""Load a running leaplm endpoint (one `leaplm serve`, or Ray Serve replicas behind one proxy) and report which
replica answered each request (`x-leaplm-replica`), tokens/s over the whole run, and end-to-end latency.

    python examples/replica_load.py --url http://127.0.0.1:8000 --requests 64 --concurrency 8 --max-tokens 64

Requests are greedy and streamed (ignore_eos, so each generates exactly --max-tokens); every answer to the same
prompt must be the same text whichever replica served it (lossless speculation, same weights), and the script
says so. Needs only httpx.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

PROMPTS = ["def fib(n):", "import os\n", "class Stack:\n", "for i in range(", "def parse(path):\n", "x = [",
           "while True:\n", "def add(a, b):\n"]


async def one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0, text = time.perf_counter(), ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        replica = r.headers.get("x-leaplm-replica", "-")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return {"prompt": prompt, "replica": replica, "text": text, "e2e_s": time.perf_counter() - t0}


async def main(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    jobs: asyncio.Queue = asyncio.Queue()
    for i in range(args.requests):
        jobs.put_nowait(PROMPTS[i % len(PROMPTS)])
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def worker():
            while not jobs.empty():
                results.append(await one(client, model, jobs.get_nowait(), args.max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(args.concurrency)])
        wall = time.perf_counter() - t0
    by_replica: dict[str, int] = {}
    for r in results:
        by_replica[r["replica"]] = by_replica.get(r["replica"], 0) + 1
    texts = {p: {r["text"] for r in results if r["prompt"] == p} for p in PROMPTS}
    e2e = sorted(r["e2e_s"] for r in results)
    return {"url": args.url, "requests": len(results), "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(len(results) * args.max_tokens / wall, 1),
            "e2e_p50_s": round(statistics.median(e2e), 3), "e2e_p90_s": round(e2e[int(0.9 * (len(e2e) - 1))], 3),
            "by_replica": by_replica, "same_text_per_prompt": all(len(t) <= 1 for t in texts.values())}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300.0)
    print(json.dumps(asyncio.run(main(ap.parse_args())), indent=1))

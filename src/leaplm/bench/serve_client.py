"""`leaplm bench serve`'s load generation: streamed greedy requests from `concurrency` client workers, each timed
as a client sees it (first token, inter-token gaps, end to end), over the lean SSE client (sse_client.py); the
long-prompt scenario; and the gauges read from the server's /metrics."""
from __future__ import annotations

import asyncio
import time

from . import sse_client
from .serve_config import PROMPTS, LoadBenchConfig, RequestResult
from .serve_report import percentile

async def send_one(url: str, body: dict, timeout: float, on_first=None) -> RequestResult:
    """One streamed completion request, timed (first token, inter-token gaps, end to end)."""
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    try:
        async with asyncio.timeout(timeout):
            async with sse_client.post(url, "/v1/completions", body) as r:
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.body())[:200]!r}"
                    return res
                last_t, last_n = None, 0
                async for msg in r.messages():
                    if "error" in msg:
                        res.error = msg["error"]["message"]
                        return res
                    usage = msg.get("usage") or {}
                    n = usage.get("completion_tokens", last_n)
                    now = time.perf_counter()
                    if n > last_n:
                        if last_t is None:
                            res.ttft_s = now - t0
                            if on_first is not None:
                                on_first()
                        else:
                            res.itl_s.extend([(now - last_t) / (n - last_n)] * (n - last_n))
                        last_t, last_n = now, n
                    spec = usage.get("speculative")
                    if spec:
                        res.draft_tokens, res.accepted_tokens = spec["draft_tokens"], spec["accepted_tokens"]
                res.tokens = last_n
                res.ok = True
    except (TimeoutError, asyncio.TimeoutError):
        res.error = f"timeout after {timeout} s"
    except Exception as e:  # noqa: BLE001 - counted as an error of this request
        res.error = f"{type(e).__name__}: {e}"
    res.e2e_s = time.perf_counter() - t0
    return res


async def run_level(url: str, concurrency: int, n_requests: int, speculative: bool, cfg: LoadBenchConfig,
                     offset: int) -> tuple[float, list[RequestResult]]:
    bodies = []
    for i in range(n_requests):
        b = {"model": "bench", "prompt": PROMPTS[(offset + i) % len(PROMPTS)], "max_tokens": cfg.max_tokens,
             "temperature": 0, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if not speculative:
            b["speculative"] = {"method": "none"}
        bodies.append(b)
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    results: list[RequestResult] = []

    async def worker():
        while True:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await send_one(url, body, cfg.timeout_s))

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return time.perf_counter() - t0, results


def max_model_len(url: str) -> int:
    import httpx

    return int(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"])


async def run_long_prompt(url: str, cfg: LoadBenchConfig, long_ids: list[int] | None,
                           offset: int) -> tuple[list[RequestResult], RequestResult | None]:
    """cfg.long_prompt_among streams of cfg.max_tokens; with long_ids, once every stream has its first token, one
    request with that prompt (2 tokens out) arrives among them. Returns the streams' results and the long one's."""
    n = cfg.long_prompt_among
    started = asyncio.Event()
    firsts = 0

    def first_token():
        nonlocal firsts
        firsts += 1
        if firsts == n:
            started.set()

    async def stream(i):
        body = {"model": "bench", "prompt": PROMPTS[(offset + i) % len(PROMPTS)], "max_tokens": cfg.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        return await send_one(url, body, cfg.timeout_s, on_first=first_token)

    tasks = [asyncio.ensure_future(stream(i)) for i in range(n)]
    long_res = None
    if long_ids is not None:
        await started.wait()
        await asyncio.sleep(0.05)                  # a few decoding steps of every stream before it arrives
        body = {"model": "bench", "prompt": long_ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        long_res = await send_one(url, body, cfg.timeout_s)
    return list(await asyncio.gather(*tasks)), long_res


def k_gauge(url: str) -> float | None:
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:             # a gauge is not worth a whole report
        return None
    for line in text.splitlines():
        if line.startswith("leaplm_spec_decode_k "):
            return float(line.split()[-1])
    return None


PATH_STAGES = ("wakeup", "serialize", "write")      # server/metrics.py StreamTimes


def server_path(url: str) -> dict | None:
    """The server's running totals of where streamed tokens' time goes (/metrics): its steps' seconds, the tokens
    they generated, and each stage's seconds and events from the step to the socket (StreamTimes). None when
    /metrics cannot be read. The difference of two readings covers what ran between them."""
    import re

    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None

    def sample(name: str) -> float:
        m = re.search("^" + re.escape(name) + r" (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    out = {"engine_step_s": sample("leaplm_engine_step_seconds_sum"), "steps": sample("leaplm_engine_steps_total"),
           "tokens": sample("leaplm_generation_tokens_total")}
    for stage in PATH_STAGES:
        out[stage + "_s"] = sample(f'leaplm_stream_seconds_total{{stage="{stage}"}}')
        out[stage + "_n"] = sample(f'leaplm_stream_events_total{{stage="{stage}"}}')
    return out


def path_delta(before: dict | None, after: dict | None) -> dict | None:
    """What a run added to server_path's totals."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in after}


def long_prompt_scenario(url: str, cfg: LoadBenchConfig) -> dict:
    """cfg.long_prompt_among streams alone vs the same with a long prompt arriving among them, interleaved over
    cfg.rounds rounds: the streams' inter-token latency (p50, p99, pooled) and the long prompt's TTFT."""
    tokens = min(cfg.long_prompt_tokens, max_model_len(url) - 8)
    long_ids = [100 + (i * 37) % 900 for i in range(tokens)]      # any ids in the vocabulary: no tokenizer needed
    itl: dict[bool, list[float]] = {False: [], True: []}
    ttft, errors = [], 0
    for rnd in range(cfg.rounds):
        for with_long in ((False, True) if rnd % 2 == 0 else (True, False)):
            streams, long_res = asyncio.run(run_long_prompt(url, cfg, long_ids if with_long else None, rnd))
            errors += sum(not r.ok for r in streams) + (long_res is not None and not long_res.ok)
            itl[with_long] += [t for r in streams if r.ok for t in r.itl_s]
            if long_res is not None and long_res.ttft_s is not None:
                ttft.append(long_res.ttft_s)
    p99 = {k: percentile(v, 99) for k, v in itl.items()}
    return {"streams": cfg.long_prompt_among, "prompt_tokens": tokens,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "rounds": cfg.rounds, "errors": errors,
            "itl_p50_s": {"alone": percentile(itl[False], 50), "with_long_prompt": percentile(itl[True], 50)},
            "itl_p99_s": {"alone": p99[False], "with_long_prompt": p99[True]},
            "itl_p99_ratio": p99[True] / p99[False] if p99[False] and p99[True] else None,
            "long_prompt_ttft_p50_s": percentile(ttft, 50)}

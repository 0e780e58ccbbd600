"""`leaplm bench serve --workloads edit,proofread,...`: copy-heavy requests through `leaplm serve` as a user sends
them (streamed chat completions; `complete` as a streamed completion), each with and without its prediction,
under plain decoding and the server's method.

One server process (serve_load.ServerProcess) serves every configuration: `none` and `none +prediction` are the
same server with the per-request extension `speculative: {"method": "none"}`. After a warm-up, each round sends
every prompt once per configuration, the order of the configurations rotated by round and prompt. Requests are
greedy and stop where the model stops (or at max_tokens). Per request: the decode rate, tokens after the first over
the time from the first to the last streamed token (what a reader waits for once text appears), and the
prediction's accepted and rejected tokens from the final usage chunk. Per (workload, configuration): the median
decode rate, the median over (round, prompt) of its ratio to `none`'s, and whether every text equals `none`'s.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import sse_client
from .serve_load import LoadBenchConfig, ServerProcess, machine


@dataclass
class StreamResult:
    text: str = ""
    tokens: int = 0
    first_s: float | None = None          # seconds from sending to the first token
    decode_s: float = 0.0                 # first to last token
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    error: str | None = None

    @property
    def decode_rate(self) -> float | None:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else None


@dataclass
class WorkloadSample:
    workload: str
    config: str
    prompt: int
    round: int
    result: StreamResult = field(default_factory=StreamResult)


async def stream_request(url: str, path: str, body: dict, timeout: float) -> StreamResult:
    """One streamed request; token counts from the usage on every chunk (continuous_usage_stats)."""
    res = StreamResult()
    t0 = time.perf_counter()
    first = last = None
    try:
        async with asyncio.timeout(timeout):
            async with sse_client.post(url, path, body) as r:
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.body())[:300]!r}"
                    return res
                async for msg in r.messages():
                    if "error" in msg:
                        res.error = msg["error"]["message"]
                        return res
                    for c in msg.get("choices") or []:
                        res.text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    usage = msg.get("usage") or {}
                    n = usage.get("completion_tokens", res.tokens)
                    if n > res.tokens:
                        now = time.perf_counter()
                        first = now if first is None else first
                        last = now
                        res.tokens = n
                    details = usage.get("completion_tokens_details")
                    if details and not msg.get("choices"):
                        res.accepted_prediction_tokens = details["accepted_prediction_tokens"]
                        res.rejected_prediction_tokens = details["rejected_prediction_tokens"]
    except (TimeoutError, asyncio.TimeoutError):
        res.error = f"timeout after {timeout} s"
    if first is not None:
        res.first_s, res.decode_s = first - t0, last - first
    return res


def _body(w, i: int, config: tuple[str, bool], max_tokens: int) -> tuple[str, dict]:
    method, predicted = config
    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    prompt = w.prompts[i]
    if w.chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    if method == "none":
        body["speculative"] = {"method": "none"}
    if predicted:
        body["prediction"] = {"type": "content", "content": w.predictions[i]}
    return path, body


def label(config: tuple[str, bool]) -> str:
    return config[0] + (" +prediction" if config[1] else "")


def summarize(samples: list[WorkloadSample]) -> list[dict]:
    rows = []
    keyed = {(s.workload, s.config, s.prompt, s.round): s for s in samples}
    for w in dict.fromkeys(s.workload for s in samples):
        for c in dict.fromkeys(s.config for s in samples):
            mine = [s for s in samples if s.workload == w and s.config == c and s.result.error is None]
            if not mine:
                continue
            ratios, same = [], True
            for s in mine:
                b = keyed.get((w, "none", s.prompt, s.round))
                if b is not None and b.result.error is None:
                    same &= b.result.text == s.result.text
                    if s.result.decode_rate and b.result.decode_rate:
                        ratios.append(s.result.decode_rate / b.result.decode_rate)
            rates = [s.result.decode_rate for s in mine if s.result.decode_rate]
            acc = sum(s.result.accepted_prediction_tokens for s in mine)
            rej = sum(s.result.rejected_prediction_tokens for s in mine)
            rows.append({"workload": w, "config": c, "requests": len(mine),
                         "errors": sum(1 for s in samples if s.workload == w and s.config == c) - len(mine),
                         "decode_tokens_per_s": statistics.median(rates) if rates else None,
                         "speedup_vs_none": statistics.median(ratios) if ratios else None,
                         "tokens": statistics.median(s.result.tokens for s in mine),
                         "accepted_prediction_tokens": acc, "rejected_prediction_tokens": rej,
                         "identical_to_none": same if c != "none" else None})
    return rows


def run_workloads_bench(cfg: LoadBenchConfig, workloads: list[str], prompts: int) -> dict:
    """One server (cfg's method), every workload's prompts in every configuration, cfg.rounds rounds."""
    from .workloads import as_chat, get_workload

    wls = [get_workload(name, prompts) for name in workloads]
    configs = [("none", False), ("none", True)]
    if cfg.method != "none":
        configs += [(cfg.method, False), (cfg.method, True)]
    samples: list[WorkloadSample] = []
    with tempfile.TemporaryDirectory(prefix="leaplm-bench-workloads-") as tmp:
        server = ServerProcess(cfg, cfg.model, cfg.draft, Path(tmp) / "server.log")
        try:
            server.wait_ready(cfg.startup_timeout_s)
            info = server.backend_info()

            async def go():
                for w in wls:                          # warm-up: each configuration once, untimed
                    for c in configs:
                        await stream_request(server.url, *_body(w, 0, c, 16), cfg.timeout_s)
                for rnd in range(cfg.rounds):
                    for w in wls:
                        for i in range(len(w.prompts)):
                            shift = (rnd + i) % len(configs)
                            for c in configs[shift:] + configs[:shift]:
                                res = await stream_request(server.url, *_body(w, i, c, cfg.max_tokens),
                                                           cfg.timeout_s)
                                samples.append(WorkloadSample(w.name, label(c), i, rnd, res))

            asyncio.run(go())
        finally:
            server.stop()
    report = {
        "command": "leaplm bench serve --workloads " + ",".join(workloads),
        "settings": {"rounds": cfg.rounds, "prompts": prompts, "max_tokens": cfg.max_tokens, "method": cfg.method,
                     "k": cfg.k, "threads": cfg.threads, "fixed_k": cfg.fixed_k,
                     "timing": "decode rate = tokens after the first / seconds from the first to the last streamed "
                               "token; speedup = median of per-(round, prompt) ratios vs none"},
        "models": {"target": cfg.model or "embedded", "draft": cfg.draft},
        "server": info, "machine": machine(), "table": summarize(samples),
        "samples": [asdict(s) for s in samples],
    }
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=2))
    return report

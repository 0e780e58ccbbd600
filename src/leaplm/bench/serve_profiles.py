"""`leaplm bench serve --profile short,medium,long,batch`: the latency table of the speculative-decoding articles
(time to first token, inter-token latency, end-to-end latency, tokens/s) for four kinds of traffic, with
speculation on and off.

A profile is a prompt length, a generation length and a client concurrency: `short` (a chat turn), `medium`,
`long` (a long prompt: retrieval or a file to edit) run one client at a time, the latency-bound case speculation
is for; `batch` runs 16 clients at once, the throughput-bound case where it may not pay. The server process,
warm-up, interleaving (on/off order alternating by round) and per-request measurement are those of serve_load.py;
"off" is the same server with the per-request extension `speculative: {"method": "none"}`. The speedup is the
median over rounds of the tokens/s ratio of a round's two adjacent runs.
"""
from __future__ import annotations

import asyncio
import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .serve_load import (PROMPTS, LoadBenchConfig, RequestResult, RunResult, ServerProcess, build_synthetic_pair,
                         machine, paired_speedup, percentile, send_one)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    name: str
    prompt_chars: int        # the prompt is code text of about this many characters (~3 per BPE token)
    max_tokens: int          # generated per request (ignore_eos: exactly this many)
    concurrency: int         # client workers
    requests: int            # per run


PROFILES = {p.name: p for p in [
    Profile("short", 60, 32, 1, 6),
    Profile("medium", 400, 128, 1, 3),
    Profile("long", 1500, 256, 1, 2),
    Profile("batch", 150, 64, 16, 32),
]}


def parse_profiles(spec: str) -> list[Profile]:
    from ..config import ConfigError

    names = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [n for n in names if n not in PROFILES]
    if not names or bad:
        raise ConfigError("profile", f"unknown profile {bad[0]!r}; choose from {', '.join(PROFILES)}" if bad
                          else f"give one or more of {', '.join(PROFILES)}")
    return [PROFILES[n] for n in names]


def profile_prompt(p: Profile, i: int) -> str:
    """Request i's prompt: code snippets from PROMPTS, starting at a different one per request, up to p.prompt_chars."""
    text, j = "", i
    while len(text) < p.prompt_chars:
        text += PROMPTS[j % len(PROMPTS)] + "\n"
        j += 1
    return text[:p.prompt_chars]


async def _run_profile(url: str, p: Profile, speculative: bool, timeout_s: float,
                       offset: int) -> tuple[float, list[RequestResult]]:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(p.requests):
        body = {"model": "bench", "prompt": profile_prompt(p, offset + i), "max_tokens": p.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if not speculative:
            body["speculative"] = {"method": "none"}
        queue.put_nowait(body)
    results: list[RequestResult] = []

    async def worker():
        while not queue.empty():
            results.append(await send_one(url, queue.get_nowait(), timeout_s))

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(p.concurrency)])
    return time.perf_counter() - t0, results


def summarize_profiles(profiles: list[Profile], runs: dict[str, list[RunResult]]) -> list[dict]:
    rows = []
    for p in profiles:
        for spec in (True, False):
            rs = [r for r in runs[p.name] if r.speculative == spec]
            ok = [x for r in rs for x in r.ok]
            drafted = sum(x.draft_tokens for x in ok)
            rows.append({
                "profile": p.name, "prompt_chars": p.prompt_chars, "max_tokens": p.max_tokens,
                "concurrency": p.concurrency, "speculative": spec, "requests": sum(len(r.results) for r in rs),
                "errors": sum(len(r.results) - len(r.ok) for r in rs),
                "ttft_p50_s": percentile([x.ttft_s for x in ok if x.ttft_s is not None], 50),
                "itl_p50_s": percentile([t for x in ok for t in x.itl_s], 50),
                "itl_p99_s": percentile([t for x in ok for t in x.itl_s], 99),
                "e2e_p50_s": percentile([x.e2e_s for x in ok], 50),
                # one client's view (its tokens over its own end-to-end time) and the server's (all over the wall)
                "tokens_per_s_request": statistics.median(x.tokens / x.e2e_s for x in ok) if ok else None,
                "tokens_per_s_total": statistics.median(sum(x.tokens for x in r.ok) / r.wall_s for r in rs),
                "acceptance_rate": sum(x.accepted_tokens for x in ok) / drafted if drafted else None,
                "speedup_vs_off": paired_speedup(runs[p.name], p.concurrency) if spec else 1.0,
            })
    return rows


def run_profiles(cfg: LoadBenchConfig, profiles: list[Profile]) -> dict:
    """One server, then per profile `cfg.rounds` on/off pairs (order alternating by round); the report is returned
    and written as JSON to cfg.out."""
    from ..config import ConfigError

    if cfg.rounds < 1:
        raise ConfigError("rounds", "must be >= 1")
    cfg = LoadBenchConfig(**{**asdict(cfg), "concurrency": [max(p.concurrency for p in profiles)]})
    with tempfile.TemporaryDirectory(prefix="leaplm-bench-profiles-") as tmp:
        model, draft = cfg.model, cfg.draft
        if cfg.synthetic:
            if model or draft:
                raise ConfigError("synthetic", "give either --synthetic or --model/--draft")
            model, draft = build_synthetic_pair(Path(tmp))
        server = ServerProcess(cfg, model, draft, Path(tmp) / "server.log")
        runs: dict[str, list[RunResult]] = {p.name: [] for p in profiles}
        try:
            server.wait_ready(cfg.startup_timeout_s)
            warm = Profile("warm-up", 100, 16, 2, 4)
            for spec in (True, False):
                asyncio.run(_run_profile(server.url, warm, spec, cfg.timeout_s, 0))
            info = server.backend_info()
            for p in profiles:
                for rnd in range(cfg.rounds):
                    for spec in ((True, False) if rnd % 2 == 0 else (False, True)):
                        wall, results = asyncio.run(_run_profile(server.url, p, spec, cfg.timeout_s, rnd))
                        runs[p.name].append(RunResult(p.concurrency, spec, rnd, wall, results))
                        log.info("%s spec=%s round=%d: %.1f s, %d errors", p.name, spec, rnd, wall,
                                 sum(not r.ok for r in results))
        finally:
            server.stop()
    report = {
        "command": "leaplm bench serve --profile " + ",".join(p.name for p in profiles),
        "settings": {"rounds": cfg.rounds, "k": cfg.k, "method": cfg.method, "max_batch": cfg.max_batch,
                     "threads": cfg.threads, "profiles": [asdict(p) for p in profiles]},
        "models": {"target": cfg.model or ("synthetic" if cfg.synthetic else "embedded"),
                   "draft": cfg.draft or ("synthetic" if cfg.synthetic else "embedded" if cfg.model is None
                                          else "the server's default"), "method": cfg.method,
                   "k": cfg.k},
        "server": info, "machine": machine(), "table": summarize_profiles(profiles, runs),
    }
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=2))
    return report

"""`leaplm bench serve`: a load test of the OpenAI server at several client concurrencies, with and without
speculation.

One `leaplm serve` subprocess on 127.0.0.1 per backend (`--backend llamacpp,torch`: one server each, same model
file) serves every run; "without speculation" is the same server with the per-request extension
`speculative: {"method": "none"}`, so both configurations share the process, the warm-up and the machine's state.
Runs are interleaved (spec, none, none, spec, ...; the backends' order alternating by round too) after a warm-up,
so that drift in the machine falls on both alike. Each row names its backend as the server reported it
(`leaplm_backend_info` on /metrics), and with several backends each row's tokens/s is also paired with the first
backend's plain decoding (`vs_first_backend_none`).
Each run sends a bounded number of streaming greedy requests (ignore_eos, so every request generates exactly
max_tokens) from `concurrency` client workers, each request with a timeout.

Per configuration and concurrency: request and token throughput (median over rounds), the speedup (median over
rounds of the ratio of a round's two adjacent runs), TTFT and inter-token latency p50/p99 (pooled over rounds),
errors, acceptance, and the server's K at the end of each run. Inter-token
latency is per token: the gap between two streamed chunks shared evenly by the tokens the second one brought
(the server reports tokens so far on every chunk with stream_options.continuous_usage_stats).

--synthetic builds a target/draft pair when no trained family is at hand: the target has 8 layers of width 256
(SYNTHETIC_WIDTH) whose layers 2..8 only weakly perturb what layer 1 computes (their output projections scaled by
EPS), and the draft is layer 1 alone with the same embeddings and head. Costs are those of a ~8M-parameter target
and a ~2M-parameter draft; acceptance is high but below 1, like a well-distilled draft's. Figures from it measure the
serving machinery, not a trained model's acceptance; the report says which models ran.

This module runs the benchmark (run_load_bench); one job per module beside it: serve_config.py (settings, prompts,
results), serve_server.py (the server processes, the synthetic pair), serve_client.py (load generation),
serve_engine.py (the engine-alone baseline, --against-engine), serve_report.py (summary rows and paired ratios).
"""
from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from dataclasses import asdict
from pathlib import Path

from .serve_client import k_gauge, long_prompt_scenario, path_delta, run_level, send_one, server_path
from .serve_config import BACKENDS, PROMPTS, LoadBenchConfig, RequestResult, RunResult, check_backends
from .serve_engine import EngineAlone
from .serve_report import (decode_rate, paired_decode_ratio, paired_ratio, paired_speedup, percentile, summarize,
                           tokens_per_s)
from .serve_server import EPS, SYNTHETIC_WIDTH, ServerProcess, build_synthetic_pair, machine

log = logging.getLogger(__name__)

# what the serve_* modules' users import from here (the one entry point of the load benchmark)
__all__ = ["BACKENDS", "EPS", "PROMPTS", "SYNTHETIC_WIDTH", "EngineAlone", "LoadBenchConfig", "RequestResult",
           "RunResult", "ServerProcess", "build_synthetic_pair", "check_backends", "decode_rate", "machine",
           "paired_decode_ratio", "paired_ratio", "paired_speedup", "percentile", "run_load_bench", "send_one",
           "summarize"]


def run_load_bench(cfg: LoadBenchConfig) -> dict:
    """Start the server, run every (concurrency, configuration) `rounds` times interleaved; return the report (and
    write it as JSON to cfg.out)."""
    from ..config import ConfigError

    if cfg.max_tokens < 2:
        raise ConfigError("max_tokens", "must be >= 2 (inter-token latency needs two tokens)")
    if cfg.rounds < 1:
        raise ConfigError("rounds", "must be >= 1")
    check_backends(cfg)
    if cfg.long_prompt_among and len(cfg.backends) > 1:
        raise ConfigError("long_prompt_among", "the long-prompt scenario runs on one backend; give one --backend")
    with tempfile.TemporaryDirectory(prefix="leaplm-bench-serve-") as tmp:
        model, draft = cfg.model, cfg.draft
        if cfg.synthetic:
            if model or draft:
                raise ConfigError("synthetic", "give either --synthetic or --model/--draft")
            model, draft = build_synthetic_pair(Path(tmp))
        servers: dict[str, ServerProcess] = {}
        alone: EngineAlone | None = None
        try:
            for b in cfg.backends:          # every server up (and warm) before the first timed run
                servers[b] = ServerProcess(cfg, model, draft, Path(tmp) / f"server-{b}.log", backend=b)
                servers[b].wait_ready(cfg.startup_timeout_s)
                warm = LoadBenchConfig(**{**asdict(cfg), "max_tokens": min(cfg.max_tokens, 16)})
                for spec in ((False,) if cfg.method == "none" else (True, False)):
                    asyncio.run(run_level(servers[b].url, 2, 4, spec, warm, 0))
            if cfg.against_engine:
                alone = EngineAlone(cfg, model, draft)
                alone.run(2, 4, True, LoadBenchConfig(**{**asdict(cfg), "max_tokens": min(cfg.max_tokens, 16)}), 0)
            info = {b: srv.backend_info() for b, srv in servers.items()}
            for b, i in info.items():
                log.info("server --backend %s: %s (%s)", b, i["backend"], i["exactness"])
            runs: list[RunResult] = []
            first = servers[cfg.backends[0]]
            long_prompt = long_prompt_scenario(first.url, cfg) if cfg.long_prompt_among else None
            for c in cfg.concurrency:
                n = cfg.requests or max(16, 4 * c)
                for rnd in range(cfg.rounds):
                    order = (True, False) if rnd % 2 == 0 else (False, True)
                    if cfg.method == "none":        # nothing to compare with: plain decoding's runs only
                        order = (False,)
                    for b in (cfg.backends if rnd % 2 == 0 else cfg.backends[::-1]):
                        url = servers[b].url
                        for spec in order:
                            before = server_path(url)
                            wall, results = asyncio.run(run_level(url, c, n, spec, cfg, rnd))
                            runs.append(RunResult(c, spec, rnd, wall, results, k_gauge(url), backend=b,
                                                  server_path=path_delta(before, server_path(url))))
                            if alone is not None and b == alone.backend:    # the same requests, the engine alone
                                wall, results = alone.run(c, n, spec, cfg, rnd)
                                runs.append(RunResult(c, spec, rnd, wall, results, None, backend=b, path="engine"))
                            if cfg.out:         # what is measured so far survives a crash later in the run
                                Path(cfg.out).write_text(json.dumps({"partial": True, "long_prompt": long_prompt,
                                                                     "summary": summarize(runs, info)}, indent=2))
                            log.info("c=%d backend=%s spec=%s round=%d: %.1f s, %d errors", c, b, spec, rnd, wall,
                                     sum(not r.ok for r in results))
        finally:
            if alone is not None:
                alone.stop()
            for srv in servers.values():
                srv.stop()
    report = {
        "command": "leaplm bench serve", "settings": asdict(cfg),
        "models": {"target": cfg.model or ("synthetic" if cfg.synthetic else "embedded"),
                   "draft": cfg.draft or ("synthetic" if cfg.synthetic else "embedded" if cfg.model is None
                                          else "the server's default"), "method": cfg.method,
                   "k": cfg.k},
        "servers": list(info.values()),
        "machine": machine(), "summary": summarize(runs, info), "long_prompt": long_prompt,
        "runs": [{"concurrency": r.concurrency, "backend": info[r.backend]["backend"], "requested_backend": r.backend,
                  "path": r.path, "speculative": r.speculative, "round": r.round, "wall_s": r.wall_s,
                  "tokens_per_s": tokens_per_s(r), "errors": len(r.results) - len(r.ok), "k_at_end": r.k_at_end}
                 for r in runs],
    }
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=2))
    return report

"""`leaplm bench serve`: the server under load at several concurrencies, with and without speculation
(bench/serve_load.py), or a latency table of traffic profiles (bench/serve_profiles.py)."""
from __future__ import annotations

from typing import Optional

import typer

from ..config import ConfigError
from .common import err, fail


def bench_serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target (default: the embedded model)."),
    draft: Optional[str] = typer.Option(None, "--draft", "--speculative-model", help="Draft model."),
    method: str = typer.Option("draft", "--method", "--speculative-method", help="Speculative method to compare."),
    k: int = typer.Option(5, "--k", "-k", "--num-speculative-tokens"),
    synthetic: bool = typer.Option(False, "--synthetic",
                                   help="Build a synthetic target/draft pair (see bench/serve_load.py) instead."),
    concurrency: str = typer.Option("1,4,16", help="Comma-separated client concurrency levels."),
    requests: int = typer.Option(0, help="Requests per run (default: max(16, 4 x concurrency))."),
    max_tokens: int = typer.Option(64, "--max-tokens"),
    rounds: int = typer.Option(2, help="Runs of each configuration, interleaved (spec, none, spec, none, ...)."),
    max_batch: int = typer.Option(16, "--max-batch"),
    threads: Optional[int] = typer.Option(None, help="torch threads of the server."),
    timeout: float = typer.Option(120.0, help="Per-request timeout, seconds."),
    out: str = typer.Option("bench-serve.json", "--out", help="JSON report path."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Latency table of traffic profiles instead of "
                                          "the concurrency sweep: short,medium,long,batch (TTFT, ITL, e2e, tokens/s)."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG of speedup against concurrency here."),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens",
                                                         help="The server's prefill chunk budget per step."),
    long_prompt_among: int = typer.Option(0, "--long-prompt-among", help="Also measure N running streams' "
                                          "inter-token latency with and without a long prompt arriving."),
    long_prompt_tokens: int = typer.Option(2000, "--long-prompt-tokens",
                                           help="Its length (capped to the server's context)."),
    adaptive_k: bool = typer.Option(True, "--adaptive-k/--fixed-k",
                                    help="The server's K policy (--fixed-k: always draft --k)."),
) -> None:
    """Load-test `leaplm serve` on 127.0.0.1 at several concurrencies, with and without speculation."""
    from ..bench.serve_load import LoadBenchConfig, print_report, run_load_bench

    if profile is not None:
        from ..bench.serve_profiles import parse_profiles, print_profiles, run_profiles

        cfg = LoadBenchConfig(model=model, draft=draft, method=method, k=k, synthetic=synthetic, rounds=rounds,
                              max_batch=max_batch, threads=threads, timeout_s=timeout, out=out,
                              fixed_k=not adaptive_k)
        try:
            print_profiles(run_profiles(cfg, parse_profiles(profile)))
        except ConfigError as e:
            fail(f"--{e.field.replace('_', '-')}: {e.message}")
        err.print(f"wrote {out}")
        return

    try:
        levels = [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        fail(f"--concurrency: expected comma-separated integers, got {concurrency!r}")
    if (not levels and not long_prompt_among) or any(c < 1 for c in levels):
        fail("--concurrency: levels must be >= 1")
    if long_prompt_among < 0 or long_prompt_tokens < 2:
        fail("--long-prompt-among must be >= 0 and --long-prompt-tokens >= 2")
    cfg = LoadBenchConfig(model=model, draft=draft, method=method, k=k, synthetic=synthetic, concurrency=levels,
                          requests=requests, max_tokens=max_tokens, rounds=rounds, max_batch=max_batch,
                          threads=threads, timeout_s=timeout, out=out, max_num_batched_tokens=max_num_batched_tokens,
                          long_prompt_among=long_prompt_among, long_prompt_tokens=long_prompt_tokens,
                          fixed_k=not adaptive_k)
    try:
        report = run_load_bench(cfg)
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}")
    print_report(report)
    err.print(f"wrote {out}")
    if plot and report["summary"]:
        from ..bench.report import plot_serve_speedup

        plot_serve_speedup(report, plot)
        err.print(f"wrote {plot}")

"""`leaplm bench serve`: the server under load at several concurrencies, with and without speculation
(bench/serve_load.py), or a latency table of traffic profiles (bench/serve_profiles.py)."""
from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from ..config import ConfigError
from .common import EngineOptions, engine_options, err, fail, out


@engine_options(without=("backend",))
def bench_serve(
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
    workloads: Optional[str] = typer.Option(None, "--workloads", help="Copy-heavy requests instead of the "
                                            "concurrency sweep: edit,proofread,quote,agent,complete, each streamed "
                                            "with and without its prediction, under none and --method."),
    prompts: int = typer.Option(4, "--prompts", help="--workloads: prompts per workload."),
    adaptive_k: bool = typer.Option(True, "--adaptive-k/--fixed-k",
                                    help="The server's K policy (--fixed-k: always draft --k)."),
    against_engine: bool = typer.Option(False, "--against-engine", help="Also run the same requests through the "
                                        "engine alone (in this process, no HTTP) and report each server row's "
                                        "decode rate against it (vs engine)."),
    stream_interval_ms: Optional[float] = typer.Option(None, "--stream-interval-ms", help="The server's "
                                                       "--stream-interval-ms (default: serve's)."),
    backend: str = typer.Option("auto", "--backend", help="What runs the model, one server each, runs "
                                "interleaved: a comma list of auto | llamacpp | torch (e.g. llamacpp,torch: the "
                                "same file on libllama and on PyTorch; --quantization applies to the torch ones)."),
    *, options: EngineOptions,
) -> None:
    """Load-test `leaplm serve` on 127.0.0.1 at several concurrencies, with and without speculation."""
    from ..bench.serve_load import LoadBenchConfig, check_backends, run_load_bench

    engine = dict(model=options.model, threads=options.threads, dtype=options.dtype,
                  quantization=options.quantization, kv_cache_dtype=options.kv_cache_dtype,
                  max_model_len=options.max_model_len, device=options.device,
                  backends=[b.strip() for b in backend.split(",") if b.strip()])
    try:
        check_backends(LoadBenchConfig(**engine))
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}")
    if workloads is not None:
        from ..bench.workloads import PREDICTED_WORKLOADS

        names = [x.strip() for x in workloads.split(",") if x.strip()]
        bad = [x for x in names if x not in PREDICTED_WORKLOADS]
        if not names or bad:
            fail(f"--workloads: a comma list of {', '.join(PREDICTED_WORKLOADS)}, got {workloads!r}")
        if prompts < 1 or rounds < 1:
            fail("--prompts and --rounds must be >= 1")
        if len(engine["backends"]) > 1:
            fail("--backend: --workloads runs one server; give one backend")
        from ..bench.serve_workloads import run_workloads_bench

        cfg = LoadBenchConfig(draft=draft, method=method, k=k, rounds=rounds, max_tokens=max_tokens,
                              max_batch=max_batch, timeout_s=timeout, out=out, fixed_k=not adaptive_k,
                              concurrency=[1], **engine)
        print_workloads(run_workloads_bench(cfg, names, prompts))
        err.print(f"wrote {out}")
        return
    if profile is not None:
        from ..bench.serve_profiles import parse_profiles, run_profiles

        if len(engine["backends"]) > 1:
            fail("--backend: --profile runs one server; give one backend")
        cfg = LoadBenchConfig(draft=draft, method=method, k=k, synthetic=synthetic, rounds=rounds,
                              max_batch=max_batch, timeout_s=timeout, out=out, fixed_k=not adaptive_k, **engine)
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
    cfg = LoadBenchConfig(draft=draft, method=method, k=k, synthetic=synthetic, concurrency=levels,
                          requests=requests, max_tokens=max_tokens, rounds=rounds, max_batch=max_batch,
                          timeout_s=timeout, out=out, max_num_batched_tokens=max_num_batched_tokens,
                          long_prompt_among=long_prompt_among, long_prompt_tokens=long_prompt_tokens,
                          fixed_k=not adaptive_k, against_engine=against_engine,
                          stream_interval_ms=stream_interval_ms, **engine)
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


def print_report(report: dict) -> None:
    s = report["settings"]
    t = Table(title=f"leaplm bench serve: {report['models']['target']} + {report['models']['draft']} "
                    f"({report['models']['method']}, K<={report['models']['k']}), {s['max_tokens']} tokens/request, "
                    f"{s['rounds']} rounds")
    several = len(report.get("servers", [])) > 1
    first = report["servers"][0]["backend"] if several else None
    engine = any(r.get("path") == "engine" for r in report["summary"])
    cols = ["conc.", "backend", "spec", *(["path"] if engine else []), "req/s", "tok/s", "speedup",
            *([f"vs {first} off"] if several else []), *(["decode tok/s", "vs engine"] if engine else []),
            "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "accept", "K at end", "errors"]
    for col in cols:
        t.add_column(col, justify="left" if col == "backend" else "right")
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f} ms"  # noqa: E731
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"     # noqa: E731
    for r in report["summary"]:
        name = r["backend"] + (f" ({r['quantization']})" if r.get("quantization") else "")
        vs = [f(r["vs_first_backend_none"]) + "x" if r["vs_first_backend_none"] else "-"] if several else []
        path = [r.get("path", "server")] if engine else []
        dec = [f(r.get("decode_tokens_per_s_p50"), 1), f(r.get("vs_engine")) + "x" if r.get("vs_engine") else "-"
               ] if engine else []
        t.add_row(str(r["concurrency"]), name, "on" if r["speculative"] else "off", *path, f(r["requests_per_s"]),
                  f(r["tokens_per_s"], 1), f(r["speedup_vs_none"]) + "x" if r["speedup_vs_none"] else "-", *vs, *dec,
                  ms(r["ttft_p50_s"]), ms(r["ttft_p99_s"]), ms(r["itl_p50_s"]), ms(r["itl_p99_s"]),
                  f(r["acceptance_rate"]), ",".join(f(k, 0) for k in r["k_at_end"]), str(r["errors"]))
    out.print(t)
    print_server_path(report)
    lp = report.get("long_prompt")
    if lp:
        out.print(
            f"long prompt ({lp['prompt_tokens']} tokens) among {lp['streams']} streams, max_num_batched_tokens="
            f"{lp['max_num_batched_tokens']}: their ITL p99 {ms(lp['itl_p99_s']['alone'])} alone, "
            f"{ms(lp['itl_p99_s']['with_long_prompt'])} with it ({f(lp['itl_p99_ratio'])}x); p50 "
            f"{ms(lp['itl_p50_s']['alone'])} / {ms(lp['itl_p50_s']['with_long_prompt'])}; its TTFT "
            f"{ms(lp['long_prompt_ttft_p50_s'])}; {lp['errors']} errors")


def print_server_path(report: dict) -> None:
    """Where a generated token's time went in the server, per server row (the server's own counters; the loop's
    stages run beside the next step's forward, so they are not a sum)."""
    rows = [r for r in report["summary"] if r.get("server_path_ms_per_token")]
    if not rows:
        return
    t = Table(title="in the server, per generated token: its step, the event loop's wake-up after it, building "
                    "its stream chunks, writing them")
    for col in ("conc.", "backend", "spec", "step ms", "wake-up ms", "serialize ms", "write ms", "tokens/step",
                "wake-ups/token", "writes/token"):
        t.add_column(col, justify="left" if col == "backend" else "right")
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"     # noqa: E731
    for r in rows:
        p = r["server_path_ms_per_token"]
        t.add_row(str(r["concurrency"]), r["backend"], "on" if r["speculative"] else "off", f(p["engine_step"]),
                  f(p["wakeup"]), f(p["serialize"]), f(p["write"]), f(p["tokens_per_step"], 2),
                  f(p["wakeups_per_token"], 2), f(p["writes_per_token"], 2))
    out.print(t)


def print_profiles(report: dict) -> None:
    m = report["models"]
    srv = report["server"]
    t = Table(title=f"leaplm bench serve --profile: {m['target']} + {m['draft']} ({m['method']}, K<={m['k']}), "
                    f"backend {srv['backend']}{f' ({q})' if (q := srv['quantization']) else ''}, "
                    f"{report['settings']['rounds']} rounds")
    for col in ["profile", "prompt", "tokens", "clients", "spec", "TTFT p50", "ITL p50", "ITL p99", "e2e p50",
                "tok/s/req", "tok/s total", "speedup", "accept", "errors"]:
        t.add_column(col, justify="right")
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f} ms"   # noqa: E731
    f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"      # noqa: E731
    for r in report["table"]:
        t.add_row(r["profile"], f"{r['prompt_chars']} ch", str(r["max_tokens"]), str(r["concurrency"]),
                  "on" if r["speculative"] else "off", ms(r["ttft_p50_s"]), ms(r["itl_p50_s"]), ms(r["itl_p99_s"]),
                  ms(r["e2e_p50_s"]), f(r["tokens_per_s_request"]), f(r["tokens_per_s_total"]),
                  f(r["speedup_vs_off"], 2) + "x" if r["speedup_vs_off"] else "-", f(r["acceptance_rate"], 2),
                  str(r["errors"]))
    out.print(t)


def print_workloads(report: dict) -> None:
    s = report["settings"]
    t = Table(title=f"leaplm bench serve --workloads: {report['models']['target']}, backend "
                    f"{report['server']['backend']}, greedy, streamed, up to {s['max_tokens']} tokens, "
                    f"{s['rounds']} rounds x {s['prompts']} prompts")
    for col in ("workload", "config", "decode tok/s", "speedup vs none", "tokens", "prediction acc/rej", "= none",
                "errors"):
        t.add_column(col, justify="left" if col in ("workload", "config") else "right")
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"     # noqa: E731
    for r in report["table"]:
        same = "-" if r["identical_to_none"] is None else ("yes" if r["identical_to_none"] else "NO")
        t.add_row(r["workload"], r["config"], f(r["decode_tokens_per_s"], 1),
                  f(r["speedup_vs_none"]) + "x" if r["speedup_vs_none"] else "-", f(r["tokens"], 0),
                  f"{r['accepted_prediction_tokens']}/{r['rejected_prediction_tokens']}", same, str(r["errors"]))
    out.print(t)

"""`leaplm serve` and `leaplm bench serve` (cli.py and bench/cli_bench.py register these functions).

Option names are leaplm's, with vLLM's spellings accepted as aliases (--speculative-model,
--num-speculative-tokens, --speculative-method), so a vLLM command line mostly carries over.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Optional

import typer
import uvicorn
from rich.console import Console

from ..config import ConfigError, ServerConfig

err = Console(stderr=True)
log = logging.getLogger(__name__)


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def serve(
    model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", help="Target, as `vllm serve MODEL` "
                                              "(same as --model)."),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Target: local HF checkpoint dir, a .gguf file or hub id (default: the "
                                             "embedded model)."),
    draft: Optional[str] = typer.Option(None, "--draft", "--speculative-model", "-md", "--model-draft",
                                        help="Draft model for --method draft (default: the embedded draft)."),
    method: Optional[str] = typer.Option(None, "--method", "--speculative-method",
                                         help="none|draft|ngram|suffix|lookahead|layerskip (default: draft when a "
                                              "draft is known, else none). Requests may override it."),
    k: int = typer.Option(5, "--k", "-k", "--num-speculative-tokens", "--draft-max",
                          help="Most speculative tokens per step; the server lowers it (to 0) as the batch fills."),
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LEAPLM_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1/* (not /health, /metrics)."),
    max_batch: int = typer.Option(8, "--max-batch", "--max-num-seqs", help="Requests decoded together."),
    max_queue: int = typer.Option(64, "--max-queue", help="Waiting sequences (prompts x n) beyond the batch's rows: "
                                  "over max_batch + max_queue in flight, new requests get 429."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", "-c", "--ctx-size",
                                                help="Context (prompt + output) per request (default: min(the "
                                                     "model's, 4096)); the cache grows with the requests, up to "
                                                     "this per row."),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, "--max-num-batched-tokens", help="Tokens a step may feed the model: longer prompts are prefilled in "
                                               "chunks between decoding steps of running streams (default: whole)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name",
                                                    help="Name clients pass as `model` (default: --model)."),
    drain_timeout: float = typer.Option(30.0, "--drain-timeout", help="Seconds SIGTERM waits for running requests."),
    max_body_bytes: int = typer.Option(4 << 20, "--max-body-bytes", help="Largest request body (413 beyond)."),
    allowed_hosts: Optional[str] = typer.Option(
        None, "--allowed-hosts", help="Comma-separated Host header names answered (others get 400: DNS rebinding); "
                                      "default: the loopback names when bound to loopback, any otherwise; '*': any."),
    request_read_timeout: float = typer.Option(10.0, "--request-read-timeout",
                                               help="Seconds a client has to send a whole request (408 beyond)."),
    keep_alive_timeout: float = typer.Option(5.0, "--keep-alive-timeout",
                                             help="Seconds an idle keep-alive connection stays open."),
    kv_cache_bytes: Optional[int] = typer.Option(
        None, "--kv-cache-bytes", "--kv-cache-memory", "--kv-cache-memory-bytes", help="KV-cache memory admitted sequences may reserve (prompt + max_tokens each); "
                                       "400 for a request that never fits, 429 for one that does not fit now "
                                       "(default: what the cache rows hold)."),
    adaptive_k: bool = typer.Option(True, "--adaptive-k/--fixed-k", help="Choose K per step from measured costs."),
    device: str = typer.Option("cpu", help="cpu|cuda|mps"),
    draft_device: Optional[str] = typer.Option(None, "--draft-device",
                                               help="Device of the draft model (default: --device), e.g. cpu "
                                                    "while the target is on cuda."),
    dtype: str = typer.Option("float32", help="float32|bfloat16|float16|auto (auto: the checkpoint's dtype)."),
    quantization: Optional[str] = typer.Option(None, "--quantization", help="int8 | int4 | gguf: weight-only "
                                               "quantization of target and draft (see `leaplm generate --help`)."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype",
                                       help="KV-cache dtype: auto (the model's)|float32|bfloat16|float16."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="torch CPU threads (default: torch's choice)."),
    speculative_config: Optional[str] = typer.Option(
        None, "--speculative-config", help="vLLM's JSON: method (ngram|draft_model|suffix|...), "
                                           "num_speculative_tokens, prompt_lookup_max/min, model (the draft)."),
    draft_min: Optional[int] = typer.Option(None, "--draft-min", hidden=True),      # llama.cpp's: refused
    n_gpu_layers: Optional[int] = typer.Option(None, "-ngl", "--n-gpu-layers", "--gpu-layers", hidden=True),
    log_level: str = typer.Option("info", "--log-level", help="debug|info|warning|error"),
    replicas: int = typer.Option(1, "--replicas", help="Engine replicas behind one HTTP endpoint (needs --backend ray)."),
    backend: str = typer.Option("local", "--backend", help="local (this process) | ray (Ray Serve replicas, "
                                                           "pip install 'leaplm[ray]')."),
) -> None:
    """Serve the OpenAI API (completions, chat, models) with speculative decoding and continuous batching."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ..cli_aliases import ALIAS_FLAGS, check_llama_cpp_only, parse_speculative_config, pick

    try:
        model = pick(model, model_arg, "--model", "MODEL")
        check_llama_cpp_only(draft_min, n_gpu_layers)
        sc = parse_speculative_config(speculative_config)
        method, draft = pick(method, sc.method, "--method", "--speculative-config method"), sc.draft or draft
    except ConfigError as e:
        _fail(f"{ALIAS_FLAGS.get(e.field, '--' + e.field.replace('_', '-'))}: {e.message}")
    try:                              # bad paths and files refused now, not after the server has started
        from ..models.loading import check_source

        for name, field in ((model, "model"), (draft, "draft")):
            if name is not None:
                check_source(name, field)
    except ConfigError as e:
        _fail(f"--{e.field}: {e.message}")
    k = sc.k if sc.k is not None else k
    spec_options = {n: v for n, v in (("ngram_min", sc.ngram_min), ("ngram_max", sc.ngram_max)) if v is not None}
    try:
        config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                              max_batch=max_batch, max_queue=max_queue, max_model_len=max_model_len,
                              max_body_bytes=max_body_bytes, drain_timeout_s=drain_timeout,
                              allowed_hosts=allowed_hosts, request_read_timeout_s=request_read_timeout,
                              keep_alive_timeout_s=keep_alive_timeout, kv_cache_bytes=kv_cache_bytes)
    except ConfigError as e:
        _fail(f"--{e.field.replace('_', '-')}: {e.message}")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        _fail("--max-num-batched-tokens: must be >= 1")
    if threads is not None:
        if threads < 1:
            _fail("--threads: must be >= 1")
        import torch

        torch.set_num_threads(threads)
    if draft_device is not None:
        from ..devices import check_device

        try:
            check_device(draft_device, "draft_device")
        except ConfigError as e:
            _fail(f"--draft-device: {e.message}")
    if quantization is not None:
        from ..quant.apply import check_quantization

        try:
            check_quantization(quantization)
        except ConfigError as e:
            _fail(f"--quantization: {e.message}")
    if replicas != 1 or backend != "local":
        if quantization is not None:
            _fail("--quantization: not yet passed to Ray Serve replicas (use --backend local)")
        from ..deploy.ray import serve_from_cli

        raise typer.Exit(serve_from_cli(_fail, replicas=replicas, backend=backend, model=model, draft=draft,
                                        method=method, k=k, host=host, port=port, api_key=api_key,
                                        max_batch=max_batch, max_queue=max_queue, max_model_len=max_model_len,
                                        served_model_name=served_model_name, drain_timeout_s=drain_timeout,
                                        adaptive_k=adaptive_k, device=device, draft_device=draft_device,
                                        dtype=dtype, threads=threads or 1, allowed_hosts=allowed_hosts,
                                        kv_cache_bytes=kv_cache_bytes))
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable beyond this machine%s%s", host,
                    "" if api_key else " and has no --api-key",
                    "" if allowed_hosts else " (no Host check: pass --allowed-hosts to add one)")

    def load():
        from ..engine.engine import Engine

        return Engine(model, draft=draft, method=method, k=k, device=device, dtype=dtype, draft_device=draft_device,
                      quantization=quantization,
                      max_model_len=max_model_len, adaptive_k=adaptive_k,
                      max_num_batched_tokens=max_num_batched_tokens, kv_cache_dtype=kv_cache_dtype,
                      **spec_options)

    code = run_server(config, load, model_name=model or "leaplm-embedded")
    raise typer.Exit(code)


def run_server(config: ServerConfig, load, model_name: str) -> int:
    """Run uvicorn with leaplm's drain on SIGTERM/SIGINT until it exits; returns the process exit code."""
    from .app import create_app
    from .http_protocol import uvicorn_config

    holder: dict = {}

    def on_load_error(message: str) -> None:
        holder["failed"] = message
        srv = holder.get("server")
        if srv is not None:
            srv.should_exit = True

    app = create_app(config, load=load, model_name=model_name, on_load_error=on_load_error)
    ucfg = uvicorn_config(app, config)
    server = DrainingServer(ucfg, app.state.leaplm, config.drain_timeout_s)
    holder["server"] = server
    log.info("leaplm serving %s on http://%s:%d", app.state.leaplm.model_name, config.host, config.port)
    server.run()
    if "failed" in holder:
        err.print(f"[bold red]error:[/] {holder['failed']}")
        return 2 if app.state.leaplm.load_error_is_input else 1
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn, with leaplm's shutdown on SIGTERM/SIGINT:

    1st signal  drain: new requests get 503, /health 503, running ones finish (up to the drain timeout), exit 0.
    2nd signal  stop now, cleanly: every running and waiting sequence is aborted, so each client gets an error
                event and [DONE] (or a JSON 503), then the server exits 0.
    3rd signal  exit without waiting for connections (uvicorn's force exit).

    Whatever the path, the scheduler thread is stopped before serve() returns: a thread still inside a torch
    kernel while the interpreter shuts down aborts the process (SIGABRT, exit 134)."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            sched = self.state.scheduler
            if sched is not None:
                await asyncio.to_thread(sched.stop)

    def handle_exit(self, sig, frame):
        self._signals += 1
        if self._loop is None:
            self.should_exit = True
            return
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if self._signals == 1:
            log.info("signal %s: draining (up to %.0f s)", name, self.drain_timeout)
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.drain()))
        elif self._signals == 2:
            log.info("signal %s again: aborting what is running and stopping", name)
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self.stop_now()))
        else:
            self.should_exit = self.force_exit = True

    async def drain(self) -> None:
        state = self.state
        state.draining = True
        sched = state.scheduler
        if sched is not None:
            sched.close_admission()
            deadline = time.monotonic() + self.drain_timeout
            while not sched.idle and time.monotonic() < deadline and not self.should_exit:
                await asyncio.sleep(0.05)
            if not sched.idle:
                log.warning("drain timeout: aborting %d running and %d waiting requests", sched.running,
                            sched.queue_depth)
                await self._abort_all("the server is shutting down (drain timeout)")
        await asyncio.sleep(0.1)            # let handlers write their last bytes
        self.should_exit = True

    async def stop_now(self) -> None:
        self.state.draining = True
        if self.state.scheduler is not None:
            self.state.scheduler.close_admission()
            await self._abort_all("the server is shutting down (second signal)")
        await asyncio.sleep(0.1)
        self.should_exit = True

    async def _abort_all(self, reason: str) -> None:
        sched = self.state.scheduler
        sched.abort_all(reason)
        for _ in range(100):
            if sched.idle:
                break
            await asyncio.sleep(0.02)


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
            _fail(f"--{e.field.replace('_', '-')}: {e.message}")
        err.print(f"wrote {out}")
        return

    try:
        levels = [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        _fail(f"--concurrency: expected comma-separated integers, got {concurrency!r}")
    if (not levels and not long_prompt_among) or any(c < 1 for c in levels):
        _fail("--concurrency: levels must be >= 1")
    if long_prompt_among < 0 or long_prompt_tokens < 2:
        _fail("--long-prompt-among must be >= 0 and --long-prompt-tokens >= 2")
    cfg = LoadBenchConfig(model=model, draft=draft, method=method, k=k, synthetic=synthetic, concurrency=levels,
                          requests=requests, max_tokens=max_tokens, rounds=rounds, max_batch=max_batch,
                          threads=threads, timeout_s=timeout, out=out, max_num_batched_tokens=max_num_batched_tokens,
                          long_prompt_among=long_prompt_among, long_prompt_tokens=long_prompt_tokens,
                          fixed_k=not adaptive_k)
    try:
        report = run_load_bench(cfg)
    except ConfigError as e:
        _fail(f"--{e.field.replace('_', '-')}: {e.message}")
    print_report(report)
    err.print(f"wrote {out}")
    if plot and report["summary"]:
        from ..bench.report import plot_serve_speedup

        plot_serve_speedup(report, plot)
        err.print(f"wrote {plot}")

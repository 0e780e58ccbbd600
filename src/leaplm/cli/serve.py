"""`leaplm serve` (and `python -m leaplm.server`): options checked here, then the server runs
(server/runner.py).

Option names are leaplm's, with vLLM's spellings accepted as aliases (--speculative-model,
--num-speculative-tokens, --speculative-method), so a vLLM command line mostly carries over.
"""
from __future__ import annotations

import logging
from typing import Optional

import typer

from ..config import ConfigError, ServerConfig
from ..server.runner import run_server
from .common import (ADAPTIVE_K, DRAFT, DRAFT_MIN, K, N_GPU_LAYERS, SPECULATIVE_CONFIG, EngineOptions, engine_options,
                     fail, set_threads)

log = logging.getLogger(__name__)


@engine_options(without=("backend",))
def serve(
    model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", help="Target, as `vllm serve MODEL` "
                                              "(same as --model)."),
    draft: Optional[str] = DRAFT,
    method: Optional[str] = typer.Option(None, "--method", "--speculative-method",
                                         help="none|draft|ngram|suffix|lookahead|layerskip (default: draft when a "
                                              "draft is known, else none). Requests may override it."),
    k: int = K,
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LEAPLM_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on /v1/* (not /health, /metrics)."),
    max_batch: int = typer.Option(8, "--max-batch", "--max-num-seqs", help="Requests decoded together."),
    max_queue: int = typer.Option(ServerConfig.max_queue, "--max-queue",
                                  help="Waiting sequences (prompts x n) beyond the batch's rows: over max_batch + "
                                       "max_queue in flight, new requests get 429 (the default admits n = 128)."),
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
    stream_interval_ms: float = typer.Option(
        20.0, "--stream-interval-ms", help="Longest a streamed token may wait to go out with the next ones (one "
                                           "write, the same chunks; first and last tokens never wait); 0: every "
                                           "step's tokens at once."),
    kv_cache_bytes: Optional[int] = typer.Option(
        None, "--kv-cache-bytes", "--kv-cache-memory", "--kv-cache-memory-bytes", help="KV-cache memory admitted sequences may reserve (prompt + max_tokens each); "
                                       "400 for a request that never fits, 429 for one that does not fit now "
                                       "(default: what the cache rows hold)."),
    adaptive_k: bool = ADAPTIVE_K,
    draft_device: Optional[str] = typer.Option(None, "--draft-device",
                                               help="Device of the draft model (default: --device), e.g. cpu "
                                                    "while the target is on cuda."),
    speculative_config: Optional[str] = SPECULATIVE_CONFIG,
    draft_min: Optional[int] = DRAFT_MIN,
    n_gpu_layers: Optional[int] = N_GPU_LAYERS,
    log_level: str = typer.Option("info", "--log-level", help="debug|info|warning|error"),
    allow_synthetic: bool = typer.Option(False, "--allow-synthetic", help="Serve a random-weight file "
                                         "(`leaplm models synth`): its text is noise."),
    replicas: int = typer.Option(1, "--replicas", help="Engine replicas behind one HTTP endpoint (needs --backend ray)."),
    backend: str = typer.Option("auto", "--backend", help="What runs the model: auto | llamacpp | torch (the "
                                                          "engine in this process: docs/backends.md), or ray (Ray "
                                                          "Serve replicas, pip install 'leaplm[ray]'); local = auto."),
    *, options: EngineOptions,
) -> None:
    """Serve the OpenAI API (completions, chat, models) with speculative decoding and continuous batching."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .aliases import ALIAS_FLAGS, check_llama_cpp_only, parse_speculative_config, pick

    try:
        model = pick(options.model, model_arg, "--model", "MODEL")
        check_llama_cpp_only(draft_min, n_gpu_layers)
        sc = parse_speculative_config(speculative_config)
        method, draft = pick(method, sc.method, "--method", "--speculative-config method"), sc.draft or draft
    except ConfigError as e:
        fail(f"{ALIAS_FLAGS.get(e.field, '--' + e.field.replace('_', '-'))}: {e.message}")
    try:                              # bad paths and files refused now, not after the server has started
        from ..models.loading import check_source
        from ..models.synth import refuse_synthetic

        refuse_synthetic(model, allow_synthetic)
        for name, field in ((model, "model"), (draft, "draft")):
            if name is not None:
                check_source(name, field, "auto" if backend in ("local", "ray") else backend)
    except ConfigError as e:
        fail(f"--{e.field}: {e.message}")
    k = sc.k if sc.k is not None else k
    spec_options = {n: v for n, v in (("ngram_min", sc.ngram_min), ("ngram_max", sc.ngram_max)) if v is not None}
    try:
        config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                              max_batch=max_batch, max_queue=max_queue, max_model_len=options.max_model_len,
                              max_body_bytes=max_body_bytes, drain_timeout_s=drain_timeout,
                              allowed_hosts=allowed_hosts, request_read_timeout_s=request_read_timeout,
                              keep_alive_timeout_s=keep_alive_timeout, stream_interval_ms=stream_interval_ms,
                              kv_cache_bytes=kv_cache_bytes)
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        fail("--max-num-batched-tokens: must be >= 1")
    set_threads(options.threads)
    if draft_device is not None:
        from ..devices import check_device

        try:
            check_device(draft_device, "draft_device")
        except ConfigError as e:
            fail(f"--draft-device: {e.message}")
    if options.quantization is not None:
        from ..quant.apply import check_quantization

        try:
            check_quantization(options.quantization)
        except ConfigError as e:
            fail(f"--quantization: {e.message}")
    backends = ("auto", "llamacpp", "torch", "local", "ray")
    if backend not in backends:
        fail(f"--backend: must be one of {', '.join(backends)}, got {backend!r}")
    model_backend = "auto" if backend in ("local", "ray") else backend
    if replicas != 1 or backend == "ray":
        if options.quantization is not None:
            fail("--quantization: not yet passed to Ray Serve replicas (use --backend auto)")
        if options.kv_cache_dtype != "auto":
            fail("--kv-cache-dtype: not yet passed to Ray Serve replicas (use --backend auto)")
        from ..deploy.ray import serve_from_cli

        raise typer.Exit(serve_from_cli(fail, replicas=replicas, backend="ray" if backend == "ray" else "local",
                                        model=model, draft=draft,
                                        method=method, k=k, host=host, port=port, api_key=api_key,
                                        max_batch=max_batch, max_queue=max_queue, max_model_len=options.max_model_len,
                                        served_model_name=served_model_name, drain_timeout_s=drain_timeout,
                                        adaptive_k=adaptive_k, device=options.device, draft_device=draft_device,
                                        dtype=options.dtype, threads=options.threads or 1,
                                        allowed_hosts=allowed_hosts,
                                        kv_cache_bytes=kv_cache_bytes))
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable beyond this machine%s%s", host,
                    "" if api_key else " and has no --api-key",
                    "" if allowed_hosts else " (no Host check: pass --allowed-hosts to add one)")

    try:
        engine_config = options.engine_config(model=model, draft=draft, method=method, k=k, backend=model_backend,
                                              draft_device=draft_device, max_num_batched_tokens=max_num_batched_tokens,
                                              spec_options=dict(adaptive_k=adaptive_k, **spec_options))
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}")

    def load():
        from ..engine.engine import Engine

        return Engine(config=engine_config)

    code = run_server(config, load, model_name=model or "leaplm-embedded")
    raise typer.Exit(code)


def main() -> None:
    """`python -m leaplm.server ...`: the serve command on its own."""
    typer.run(serve)

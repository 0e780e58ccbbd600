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
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import sse_client

log = logging.getLogger(__name__)

PROMPTS = [
    "def parse_config(path):\n    \"\"\"Read a configuration file and",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "    for i, line in enumerate(lines):\n        if not line.strip():\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "with open(filename, encoding='utf-8') as f:\n    data =",
    "    except KeyError as e:\n        raise ValueError(",
    "# Copyright (c) Python Software Foundation.\n\n\"\"\"Utilities for",
]
EPS = 0.05
SYNTHETIC_WIDTH = 256


@dataclass
class LoadBenchConfig:
    model: str | None = None            # None: the embedded family
    draft: str | None = None
    method: str = "draft"
    k: int = 5
    synthetic: bool = False
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    requests: int = 0                    # per run; 0: max(16, 4 * concurrency)
    max_tokens: int = 64
    rounds: int = 2
    max_batch: int = 16
    threads: int | None = None
    timeout_s: float = 120.0
    out: str | None = "bench-serve.json"
    startup_timeout_s: float = 600.0
    max_num_batched_tokens: int | None = None   # the server's prefill chunking budget (None: whole prompts)
    long_prompt_among: int = 0           # > 0: the long-prompt scenario with this many running streams
    long_prompt_tokens: int = 2000       # its prompt length (capped to what the server's context holds)
    fixed_k: bool = False                # serve --fixed-k: always draft k (the controller may otherwise pick 0)
    backends: list[str] = field(default_factory=lambda: ["auto"])   # one server each: auto | llamacpp | torch
    dtype: str = "float32"               # the engine options every server gets (leaplm serve's flags)
    quantization: str | None = None      # servers whose backend is not llamacpp (libllama runs the file's types)
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    device: str = "cpu"
    against_engine: bool = False         # also run the same requests through the engine alone, in this process
    stream_interval_ms: float | None = None     # the servers' --stream-interval-ms (None: serve's default)


BACKENDS = ("auto", "llamacpp", "torch")


def check_backends(cfg: "LoadBenchConfig") -> None:
    """Each backend once and known; --quantization only where some server can honour it."""
    from ..config import ConfigError

    if not cfg.backends:
        raise ConfigError("backend", "give at least one backend")
    for b in cfg.backends:
        if b not in BACKENDS:
            raise ConfigError("backend", f"expected a comma list of {', '.join(BACKENDS)}, got {b!r}")
    if len(set(cfg.backends)) != len(cfg.backends):
        raise ConfigError("backend", f"each backend once, got {','.join(cfg.backends)}")
    if cfg.quantization and all(b == "llamacpp" for b in cfg.backends):
        raise ConfigError("quantization", f"{cfg.quantization!r} selects leaplm's own kernels; a llamacpp server "
                                          "runs the file's own weight types (add torch to --backend)")


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    e2e_s: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    error: str | None = None


@dataclass
class RunResult:
    concurrency: int
    speculative: bool
    round: int
    wall_s: float
    results: list[RequestResult]
    k_at_end: float | None = None
    backend: str = "auto"                # the --backend entry of the server that ran it
    path: str = "server"                 # "server": streamed over HTTP; "engine": the engine alone (in process)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile of xs (None when empty)."""
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def build_synthetic_pair(root: Path, eps: float = EPS, seed: int = 0, width: int = SYNTHETIC_WIDTH) -> tuple[str, str]:
    """(target_dir, draft_dir): see the module docstring. A 4096-token byte-level BPE learnt from a few
    standard-library files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..training.corpus import corpus_texts
    from ..training.tokenizer import train_tokenizer

    tdir, ddir = root / "target", root / "draft"
    tok = train_tokenizer(corpus_texts("stdlib", "train", 40), tdir, vocab_size=4096)
    tok.save_pretrained(str(ddir))
    eos = tok.eos_token_id
    kw = dict(vocab_size=len(tok), hidden_size=width, intermediate_size=3 * width, num_attention_heads=width // 64,
              num_key_value_heads=max(1, width // 128), max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=eos,
              bos_token_id=eos, initializer_range=0.05)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=8, **kw))
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
    target.save_pretrained(str(tdir))
    draft = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **kw))
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not any(f".layers.{i}." in k for i in range(1, 8))})
    draft.save_pretrained(str(ddir))
    return str(tdir), str(ddir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m leaplm.server` in a subprocess on a free local port, with its log in a file."""

    def __init__(self, cfg: LoadBenchConfig, model: str | None, draft: str | None, log_path: Path,
                 backend: str | None = None):
        self.backend = backend or cfg.backends[0]
        self.quantization = cfg.quantization if self.backend != "llamacpp" else None
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "leaplm.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--method", cfg.method, "--k", str(cfg.k), "--max-batch", str(cfg.max_batch),
               "--max-queue", str(max(64, 2 * max(cfg.concurrency))), "--served-model-name", "bench",
               "--log-level", "warning", "--backend", self.backend, "--dtype", cfg.dtype,
               "--kv-cache-dtype", cfg.kv_cache_dtype, "--device", cfg.device]
        if self.quantization:
            cmd += ["--quantization", self.quantization]
        if cfg.max_model_len:
            cmd += ["--max-model-len", str(cfg.max_model_len)]
        if model:
            cmd += ["--model", model]
        if draft:
            cmd += ["--draft", draft]
        if cfg.threads:
            cmd += ["--threads", str(cfg.threads)]
        if cfg.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
        if cfg.fixed_k:
            cmd += ["--fixed-k"]
        if cfg.stream_interval_ms is not None:
            cmd += ["--stream-interval-ms", str(cfg.stream_interval_ms)]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = log_path

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.log_path.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready after {timeout:.0f} s")

    def backend_info(self) -> dict:
        """What runs the target's forwards, as the server reports it: {"backend": ..., "exactness": ...}."""
        import re

        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(r'^leaplm_backend_info\{backend="([^"]*)",exactness="([^"]*)"\} 1', text, re.M)
        if not m:
            raise RuntimeError(f"the server's /metrics has no leaplm_backend_info line (--backend {self.backend})")
        return {"requested": self.backend, "backend": m.group(1), "exactness": m.group(2),
                "quantization": self.quantization}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


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


async def _run_level(url: str, concurrency: int, n_requests: int, speculative: bool, cfg: LoadBenchConfig,
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


class EngineAlone:
    """--against-engine: the server's requests through the engine alone, in this process: an Engine built with the
    server's options, its continuous-batching scheduler (max_batch rows, its own thread), `concurrency` requests in
    flight. Each request is timed as the client times a streamed one, at the moment each step's tokens come back:
    the same decode rate with no HTTP, asyncio or serialization in between."""

    def __init__(self, cfg: LoadBenchConfig, model: str | None, draft: str | None):
        from ..config import EngineConfig
        from ..engine.engine import Engine
        from ..engine.scheduler import BatchScheduler

        backend = cfg.backends[0]
        self.engine = Engine(config=EngineConfig(
            model, draft, cfg.method, cfg.k, backend=backend, device=cfg.device, dtype=cfg.dtype,
            quantization=cfg.quantization if backend != "llamacpp" else None, kv_cache_dtype=cfg.kv_cache_dtype,
            threads=cfg.threads, max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
            spec_options={"adaptive_k": not cfg.fixed_k}))
        self.backend = backend
        # calibrated as the server's (its K policy's costs), except where no request drafts
        self.scheduler = BatchScheduler(self.engine, max_batch=cfg.max_batch, max_queue=max(64, 2 * cfg.max_batch),
                                        calibrate=cfg.method != "none")
        self.scheduler.start()

    def run(self, concurrency: int, n_requests: int, speculative: bool, cfg: LoadBenchConfig,
            offset: int) -> tuple[float, list[RequestResult]]:
        import threading

        from ..config import SamplingParams
        from ..engine.scheduler import SeqRequest

        params = SamplingParams(max_new_tokens=cfg.max_tokens, temperature=0, ignore_eos=True)
        prompts = [self.engine.encode(PROMPTS[(offset + i) % len(PROMPTS)], params) for i in range(n_requests)]
        results: list[RequestResult] = []
        done = threading.Semaphore(0)

        def request(ids: list[int]) -> SeqRequest:
            res = RequestResult(ok=False)
            t0 = time.perf_counter()
            last: list[float | None] = [None]

            def on_output(out) -> None:               # the scheduler's thread, once per step
                now = time.perf_counter()
                n = len(out.chunk.token_ids) if out.chunk is not None else 0
                if n:
                    if last[0] is None:
                        res.ttft_s = now - t0
                    else:
                        res.itl_s.extend([(now - last[0]) / n] * n)
                    last[0] = now
                    res.tokens += n
                if out.error is not None:
                    res.error = out.error
                if out.finished:
                    res.ok = out.error is None
                    st = out.chunk.stats if out.chunk is not None else None
                    if st is not None:
                        res.draft_tokens, res.accepted_tokens = st.draft_tokens, st.accepted_tokens
                    res.e2e_s = now - t0
                    results.append(res)
                    done.release()

            return SeqRequest(ids, params, on_output, method=None if speculative else "none")

        t0 = time.perf_counter()
        pending = list(prompts)
        for _ in range(min(concurrency, len(pending))):
            self.scheduler.submit([request(pending.pop(0))])
        for _ in range(n_requests):
            if not done.acquire(timeout=cfg.timeout_s):
                raise TimeoutError(f"the engine alone did not finish a request in {cfg.timeout_s} s")
            if pending:
                self.scheduler.submit([request(pending.pop(0))])
        return time.perf_counter() - t0, results

    def stop(self) -> None:
        self.scheduler.stop()


def _max_model_len(url: str) -> int:
    import httpx

    return int(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"])


async def _run_long_prompt(url: str, cfg: LoadBenchConfig, long_ids: list[int] | None,
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


def _k_gauge(url: str) -> float | None:
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:             # a gauge is not worth a whole report
        return None
    for line in text.splitlines():
        if line.startswith("leaplm_spec_decode_k "):
            return float(line.split()[-1])
    return None


def summarize(runs: list[RunResult], servers: dict[str, dict] | None = None) -> list[dict]:
    """One row per (concurrency, backend, speculation, path), in the order the backends were given; `servers` maps a
    --backend entry to what its server reported (ServerProcess.backend_info). With engine runs (--against-engine),
    each server row has `vs_engine`: its requests' median decode rate over the engine's alone on the same requests,
    paired by round."""
    rows = []
    order = list(dict.fromkeys(r.backend for r in runs))
    keys = sorted({(r.concurrency, r.backend, r.speculative, r.path) for r in runs},
                  key=lambda x: (x[0], order.index(x[1]), not x[2], x[3] != "server"))
    for c, b, spec, path in keys:
        rs = [r for r in runs if r.concurrency == c and r.backend == b and r.speculative == spec and r.path == path]
        ok = [x for r in rs for x in r.ok]
        drafted = sum(x.draft_tokens for x in ok)
        info = (servers or {}).get(b, {})
        rows.append({
            "concurrency": c, "backend": info.get("backend", b), "requested_backend": b, "path": path,
            "exactness": info.get("exactness"), "quantization": info.get("quantization"),
            "speculative": spec, "rounds": len(rs),
            "requests": sum(len(r.results) for r in rs), "errors": sum(len(r.results) - len(r.ok) for r in rs),
            "requests_per_s": statistics.median(len(r.ok) / r.wall_s for r in rs),
            "tokens_per_s": statistics.median(sum(x.tokens for x in r.ok) / r.wall_s for r in rs),
            "decode_tokens_per_s_p50": percentile([d for x in ok if (d := decode_rate(x)) is not None], 50),
            "ttft_p50_s": percentile([x.ttft_s for x in ok if x.ttft_s is not None], 50),
            "ttft_p99_s": percentile([x.ttft_s for x in ok if x.ttft_s is not None], 99),
            "itl_p50_s": percentile([t for x in ok for t in x.itl_s], 50),
            "itl_p99_s": percentile([t for x in ok for t in x.itl_s], 99),
            "acceptance_rate": sum(x.accepted_tokens for x in ok) / drafted if drafted else None,
            "k_at_end": [r.k_at_end for r in rs],
            "error_samples": sorted({x.error for r in rs for x in r.results if x.error})[:3],
        })
    served = [r for r in runs if r.path == "server"]
    for r in rows:
        b = r["requested_backend"]
        r["vs_engine"] = (paired_decode_ratio(runs, r["concurrency"], b, r["speculative"])
                          if r["path"] == "server" else None)
        if r["path"] != "server":
            r["speedup_vs_none"] = r["vs_first_backend_none"] = None
            continue
        r["speedup_vs_none"] = paired_speedup(served, r["concurrency"], b) if r["speculative"] else 1.0
        r["vs_first_backend_none"] = (paired_ratio(served, r["concurrency"], (b, r["speculative"]),
                                                   (order[0], False)) if len(order) > 1 else None)
    return rows


def decode_rate(x: RequestResult) -> float | None:
    """A request's decode rate: tokens after its first over the time from its first token to its last."""
    gap = sum(x.itl_s)
    return len(x.itl_s) / gap if x.itl_s and gap > 0 else None


def _median_decode(run: RunResult) -> float | None:
    rates = [d for x in run.ok if (d := decode_rate(x)) is not None]
    return statistics.median(rates) if rates else None


def paired_decode_ratio(runs: list[RunResult], concurrency: int, backend: str, speculative: bool) -> float | None:
    """Median over rounds of the server's median per-request decode rate / the engine's alone, same round."""
    ratios = []
    for rnd in sorted({r.round for r in runs if r.concurrency == concurrency}):
        pair = {r.path: r for r in runs if (r.concurrency, r.backend, r.speculative, r.round)
                == (concurrency, backend, speculative, rnd)}
        if "server" in pair and "engine" in pair:
            a, b = _median_decode(pair["server"]), _median_decode(pair["engine"])
            if a and b:
                ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def _tokens_per_s(run: RunResult) -> float:
    return sum(x.tokens for x in run.ok) / run.wall_s


def paired_ratio(runs: list[RunResult], concurrency: int, a: tuple[str, bool], b: tuple[str, bool]) -> float | None:
    """Median over rounds of tokens/s of configuration a / configuration b (each a (backend, speculative) pair)
    in the same round: a round's runs are adjacent in time, so slow changes in the machine's load cancel out of
    each ratio."""
    ratios = []
    for rnd in sorted({r.round for r in runs if r.concurrency == concurrency}):
        pair = {(r.backend, r.speculative): r for r in runs if r.concurrency == concurrency and r.round == rnd}
        if a in pair and b in pair and _tokens_per_s(pair[b]) > 0:
            ratios.append(_tokens_per_s(pair[a]) / _tokens_per_s(pair[b]))
    return statistics.median(ratios) if ratios else None


def paired_speedup(runs: list[RunResult], concurrency: int, backend: str | None = None) -> float | None:
    """Speculation on / off on one backend's server (the only one when None), paired by round."""
    backend = backend if backend is not None else next((r.backend for r in runs), "auto")
    return paired_ratio(runs, concurrency, (backend, True), (backend, False))


def _long_prompt_scenario(url: str, cfg: LoadBenchConfig) -> dict:
    """cfg.long_prompt_among streams alone vs the same with a long prompt arriving among them, interleaved over
    cfg.rounds rounds: the streams' inter-token latency (p50, p99, pooled) and the long prompt's TTFT."""
    tokens = min(cfg.long_prompt_tokens, _max_model_len(url) - 8)
    long_ids = [100 + (i * 37) % 900 for i in range(tokens)]      # any ids in the vocabulary: no tokenizer needed
    itl: dict[bool, list[float]] = {False: [], True: []}
    ttft, errors = [], 0
    for rnd in range(cfg.rounds):
        for with_long in ((False, True) if rnd % 2 == 0 else (True, False)):
            streams, long_res = asyncio.run(_run_long_prompt(url, cfg, long_ids if with_long else None, rnd))
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


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None}


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
                    asyncio.run(_run_level(servers[b].url, 2, 4, spec, warm, 0))
            if cfg.against_engine:
                alone = EngineAlone(cfg, model, draft)
                alone.run(2, 4, True, LoadBenchConfig(**{**asdict(cfg), "max_tokens": min(cfg.max_tokens, 16)}), 0)
            info = {b: srv.backend_info() for b, srv in servers.items()}
            for b, i in info.items():
                log.info("server --backend %s: %s (%s)", b, i["backend"], i["exactness"])
            runs: list[RunResult] = []
            first = servers[cfg.backends[0]]
            long_prompt = _long_prompt_scenario(first.url, cfg) if cfg.long_prompt_among else None
            for c in cfg.concurrency:
                n = cfg.requests or max(16, 4 * c)
                for rnd in range(cfg.rounds):
                    order = (True, False) if rnd % 2 == 0 else (False, True)
                    if cfg.method == "none":        # nothing to compare with: plain decoding's runs only
                        order = (False,)
                    for b in (cfg.backends if rnd % 2 == 0 else cfg.backends[::-1]):
                        url = servers[b].url
                        for spec in order:
                            wall, results = asyncio.run(_run_level(url, c, n, spec, cfg, rnd))
                            runs.append(RunResult(c, spec, rnd, wall, results, _k_gauge(url), backend=b))
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
                  "tokens_per_s": _tokens_per_s(r), "errors": len(r.results) - len(r.ok), "k_at_end": r.k_at_end}
                 for r in runs],
    }
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=2))
    return report

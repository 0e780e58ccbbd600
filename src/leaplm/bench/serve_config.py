"""`leaplm bench serve`'s settings (LoadBenchConfig), the prompts its requests send, and what a request and a run
measured (RequestResult, RunResult): shared by the load generator (serve_client.py), the engine-alone baseline
(serve_engine.py), the servers (serve_server.py), the report (serve_report.py) and the orchestration
(serve_load.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

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
    server_path: dict | None = None      # what the run added to the server's step-to-socket totals (serve_client)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

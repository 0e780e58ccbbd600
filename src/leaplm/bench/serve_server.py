"""`leaplm bench serve`'s servers: `leaplm serve` subprocesses on free local ports (ServerProcess), the synthetic
target/draft pair (--synthetic, see serve_load.py's docstring) and the machine's description for the report."""
from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .serve_config import LoadBenchConfig

EPS = 0.05
SYNTHETIC_WIDTH = 256


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
              num_key_value_heads=max(1, width // 128), max_position_embeddings=1024, tie_word_embeddings=True,
              eos_token_id=eos, bos_token_id=eos, initializer_range=0.05)
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


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None}

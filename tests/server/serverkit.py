"""Server-test kit: tiny checkpoints and real `leaplm serve` processes on 127.0.0.1.

The checkpoints: a byte-level BPE tokenizer with a chat template, a 2-layer target and a 1-layer draft made of the
target's first layer (the target's second layer has its output projections scaled by EPS), so the draft agrees
with the target often but not always. Every forward costs well under a millisecond; contexts are 1024 tokens so
that a long request runs for a second or more (abort, overload and drain tests need requests in flight).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

API_KEY = "sk-leaplm-test"
MODEL = "tiny"

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them",
    "un café crème, s'il vous plaît; naïve façade — déjà vu",
    "größer über Straße, 東京 と 大阪, 🙂 🚀 emoji",
    "def add(a, b):\n    return a + b\n",
    "user assistant system: hello, how are you today?",
] * 4


def write_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE, eos: str = "<eos>"):
    """eos: the special token's name; a pair exported to GGUF needs "<|endoftext|>" (transformers' GGUF
    tokenizer adds that token to a gpt2-type vocabulary that lacks it, one token more than the model's rows)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


def write_pair(root: Path, eps: float = 0.1, seed: int = 0, max_len: int = 1024, hidden: int = 64,
               chat_template: str | None = CHAT_TEMPLATE, eos: str = "<eos>") -> tuple[str, str]:
    """(target_dir, draft_dir) under root."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(root)
    tdir, ddir = root / "target", root / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(tdir, chat_template, eos)
    tok.save_pretrained(str(ddir))
    eos = tok.eos_token_id
    kw = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=max_len, initializer_range=0.3,
              tie_word_embeddings=False, eos_token_id=eos, bos_token_id=eos, pad_token_id=None)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **kw))
    with torch.no_grad():
        last = target.model.layers[1]
        last.self_attn.o_proj.weight.mul_(eps)
        last.mlp.down_proj.weight.mul_(eps)
    target.save_pretrained(str(tdir))
    draft = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **kw))
    sd = {k: v for k, v in target.state_dict().items() if ".layers.1." not in k}
    draft.load_state_dict(sd)
    draft.save_pretrained(str(ddir))
    return str(tdir), str(ddir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m leaplm.server` (the same function as `leaplm serve`) in a subprocess on 127.0.0.1."""

    def __init__(self, target: str, draft: str | None, *args: str, api_key: str | None = API_KEY):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "leaplm.server", "--model", target, "--port", str(self.port),
               "--host", "127.0.0.1", "--served-model-name", MODEL, "--threads", "1", "--log-level", "warning"]
        if draft is not None:
            cmd += ["--draft", draft]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        cmd += list(args)
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"leaplm-serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics (0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        key = name + (("{" + labels + "}") if labels else "")
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0


class InProcessServer:
    """The same app and uvicorn server as `leaplm serve` (create_app + DrainingServer), run in a thread of the test
    process on 127.0.0.1: no second torch import, so it starts in well under a second. Signals need a process of
    their own (ServerProcess)."""

    def __init__(self, target: str, draft: str | None, method: str = "draft", k: int = 4,
                 api_key: str | None = API_KEY, engine_options: dict | None = None, **config):
        """engine_options: more Engine keyword arguments (backend, quantization, ...)."""
        import threading

        from leaplm import Engine
        from leaplm.config import ServerConfig
        from leaplm.server.app import create_app
        from leaplm.server.runner import DrainingServer
        from leaplm.server.http_protocol import uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cfg = ServerConfig(host="127.0.0.1", port=self.port, api_key=api_key, served_model_name=MODEL, **config)

        def load():
            return Engine(target, draft=draft if method == "draft" else None, method=method, k=k,
                          max_model_len=cfg.max_model_len, **(engine_options or {}))

        self.app = create_app(cfg, load=load, model_name=target)
        self.state = self.app.state.leaplm
        ucfg = uvicorn_config(self.app, cfg)
        self.server = DrainingServer(ucfg, self.state, cfg.drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.load_error:
                raise RuntimeError(self.state.load_error)
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"in-process server not ready after {timeout} s")

    def drain(self, timeout: float = 60.0) -> None:
        """What SIGTERM does (DrainingServer.handle_exit schedules exactly this), then wait for the exit."""
        import asyncio

        asyncio.run_coroutine_threadsafe(self.server.drain(), self.server._loop)
        self.thread.join(timeout)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(30)

    metric = ServerProcess.metric

"""`leaplm bench memory`: peak RSS of `leaplm generate` and `leaplm serve` on a long-context model shape, each in a
process of its own, next to the cache that preallocating every position would take.

The model is random weights in a real checkpoint directory (config.json, safetensors, a word-level tokenizer)
of a known shape, by default Llama-3.2-1B's: 16 layers, hidden 2048, 32 heads / 8 kv heads x 64, vocabulary
128256, 131072 positions. Random weights change no memory figure: the cache and the weights are sized by the
shape alone.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=True, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Llama-3.2-1B's KV cache exactly (16 layers x 8 kv heads x 64, 131072 positions: 64 KiB per token in fp32)
    # behind small weights, so generate and serve run in minutes on a shared CPU
    "llama-3.2-1b-kv": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=8,
                            num_key_value_heads=8, head_dim=64, vocab_size=4096, max_position_embeddings=131072,
                            tie_word_embeddings=True, rope_theta=500000.0),
    "tiny-131k": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,   # a check
                      num_key_value_heads=2, head_dim=16, vocab_size=2048, max_position_embeddings=131072,
                      tie_word_embeddings=True),
}


@dataclass
class MemoryFigure:
    command: str
    peak_rss_bytes: int
    kv_cache_peak_bytes: int | None      # what the process reports (generate --json, serve /metrics)
    preallocated_cache_bytes: int        # rows x max_position_embeddings x per-token bytes
    weights_bytes: int


def write_random_checkpoint(path: Path, shape: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A checkpoint of `shape` with random weights (written once; reused when config.json exists)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    td = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        names = {n: tuple(p.shape) for n, p in LlamaForCausalLM(cfg).named_parameters()}
    sd = {}
    for n, s in names.items():   # norms at 1, matrices small: finite activations through 16 layers
        sd[n] = torch.ones(s, dtype=td) if len(s) == 1 else (torch.randn(s, generator=g) * 0.02).to(td)
    save_file(sd, str(path / "model.safetensors"))
    cfg.torch_dtype = dtype
    cfg.save_pretrained(str(path))
    words = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(path))
    return path


def preallocated_bytes(cfg: dict, rows: int, elem: int) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * rows * cfg["num_key_value_heads"] * head_dim * \
        cfg["max_position_embeddings"] * elem


def _leaplm() -> list[str]:
    return [sys.executable, "-m", "leaplm.cli"]


def _vm_hwm(pid: int) -> int:
    """Peak resident set size of a running process (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure_generate(model: Path, dtype: str | None, prompt_tokens: int, new_tokens: int) -> tuple[int, int, str]:
    """(peak RSS, kv_cache_peak_bytes, command) of one `leaplm generate --json` in a child of a fresh wrapper
    process, so RUSAGE_CHILDREN's maximum is this command's alone. dtype None: the command's default."""
    prompt = " ".join(f"t{i % 1000 + 1}" for i in range(prompt_tokens))
    cmd = _leaplm() + ["generate", prompt, "--model", str(model), *(["--dtype", dtype] if dtype else []),
                       "--method", "none", "--max-new-tokens", str(new_tokens), "--ignore-eos", "--json",
                       "--threads", "1"]
    wrapper = ("import json, resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, "
               "text=True); print(json.dumps({'rc': r.returncode, 'out': r.stdout, 'err': r.stderr[-2000:], "
               "'maxrss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
    res = json.loads(subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True,
                                    check=True).stdout)
    if res["rc"] != 0:
        raise RuntimeError(f"generate failed: {res['err']}")
    stats = json.loads(res["out"])["stats"]
    shown = " ".join(cmd[3:]).replace(prompt, f"'<{prompt_tokens} tokens>'")
    return res["maxrss_kb"] * 1024, stats.get("kv_cache_peak_bytes"), shown


def measure_serve(model: Path, dtype: str, prompt_tokens: int, new_tokens: int, port: int,
                  requests: int) -> tuple[int, int, str]:
    """(peak RSS, /metrics kv_cache_peak_bytes, command) of `leaplm serve` (defaults: 8 rows) after `requests`
    completions of prompt_tokens + new_tokens, 4 at a time."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor

    if not port:                         # a free port: a fixed one may be another server's on a shared machine
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    cmd = _leaplm() + ["serve", str(model), "--dtype", dtype, "--method", "none", "--port", str(port),
                       "--threads", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        prompt = " ".join(f"t{i % 1000 + 1}" for i in range(prompt_tokens))

        def ask(i: int) -> httpx.Response:
            return httpx.post(url + "/v1/completions", timeout=1800, json={
                "model": str(model), "prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True,
                "temperature": 0})

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, range(requests)))
        bad = [r for r in answers if r.status_code != 200]
        if bad:
            raise RuntimeError(f"serve answered {bad[0].status_code}: {bad[0].text[:500]}")
        peak_cache = 0
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("leaplm_kv_cache_peak_bytes "):
                peak_cache = int(float(line.split()[-1]))
        return _vm_hwm(proc.pid), peak_cache, " ".join(cmd[3:]).replace(f"--port {port} ", "")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_memory_bench(model_dir: Path, shape: str, dtype: str, prompt_tokens: int, new_tokens: int, port: int,
                     requests: int) -> list[MemoryFigure]:
    model = write_random_checkpoint(model_dir, shape, dtype)
    cfg = json.loads((model / "config.json").read_text())
    elem = 2 if dtype in ("bfloat16", "float16") else 4
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    out = []
    rss, cache, cmd = measure_generate(model, dtype, prompt_tokens, new_tokens)
    out.append(MemoryFigure("leaplm " + cmd, rss, cache, preallocated_bytes(cfg, 1, elem), weights))
    rss, cache, cmd = measure_serve(model, dtype, prompt_tokens, new_tokens, port, requests)
    out.append(MemoryFigure("leaplm " + cmd, rss, cache, preallocated_bytes(cfg, 8, elem), weights))
    return out


def run_model_memory_bench(model: str, prompt_tokens: int, new_tokens: int) -> list[MemoryFigure]:
    """Peak RSS of `leaplm generate` on a model of the user's (a GGUF file or a checkpoint directory), as the
    command runs it by default (its dtype and backend)."""
    path = Path(model).expanduser()
    weights = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))
    rss, cache, cmd = measure_generate(path, None, prompt_tokens, new_tokens)
    return [MemoryFigure("leaplm " + cmd, rss, cache, 0, weights)]


def figures_dict(figs: list[MemoryFigure], settings: dict) -> dict:
    return {"settings": settings, "machine": {"cpus": os.cpu_count(),
                                              "self_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss},
            "figures": [asdict(f) for f in figs]}

"""Pretraining a Llama-architecture causal LM on a code corpus, resumable, saved as a Hugging Face checkpoint.

Mixed precision: bf16 autocast on CPU (about 3x fp32 here), fp32 master weights and AdamW state.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .corpus import TokenStream, corpus_texts
from .presets import llama_config

log = logging.getLogger(__name__)


@dataclass
class PretrainConfig:
    out_dir: str
    tokenizer_dir: str
    preset: str = "target-34m"
    corpus: str = "stdlib"
    tokens: int = 12_000_000          # training budget in tokens
    batch_size: int = 16
    seq_len: int = 512
    long_seq_len: int = 1024          # the last `long_fraction` of steps use this length (same tokens per step)
    long_fraction: float = 0.1
    lr: float = 1.5e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 100             # steps between resumable checkpoints
    eval_every: int = 100
    eval_batches: int = 8
    max_files: int | None = None      # limit the corpus (tests)
    bf16: bool = True

    def validate(self) -> None:
        for name in ("tokens", "batch_size", "seq_len", "warmup_steps", "save_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.long_fraction < 1:
            raise ValueError(f"long_fraction must be in [0, 1), got {self.long_fraction}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    @property
    def steps(self) -> int:
        return max(1, self.tokens // (self.batch_size * self.seq_len))


@dataclass
class StepLog:
    step: int
    steps: int
    loss: float
    lr: float
    tokens_seen: int
    tokens_per_s: float
    elapsed_s: float
    eval_loss: float | None = None


def lr_at(step: int, cfg: PretrainConfig, steps: int | None = None) -> float:
    """Linear warm-up then cosine decay to min_lr over `steps` (default cfg.steps)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, (steps or cfg.steps) - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@torch.no_grad()
def eval_loss(model, stream: TokenStream, cfg: PretrainConfig, n_batches: int) -> float:
    model.eval()
    rng = random.Random(1234)
    losses = []
    for _ in range(n_batches):
        x = stream.batch(rng, cfg.batch_size, cfg.seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            losses.append(model(input_ids=x, labels=x).loss.float().item())
    model.train()
    return sum(losses) / len(losses)


def save_hf(model, tokenizer, out_dir: Path, dtype=torch.bfloat16) -> None:
    """An HF checkpoint (config.json, model.safetensors, tokenizer, generation_config.json) in `dtype`."""
    import copy

    out_dir.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(dtype)
    m.config.torch_dtype = dtype
    m.generation_config.eos_token_id = tokenizer.eos_token_id
    m.generation_config.bos_token_id = tokenizer.eos_token_id
    m.generation_config.pad_token_id = tokenizer.eos_token_id
    m.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


def pretrain(cfg: PretrainConfig, on_step: Callable[[StepLog], None] | None = None):
    """Train (or resume) and write the final checkpoint to cfg.out_dir; returns the last StepLog."""
    from transformers import LlamaForCausalLM

    cfg.validate()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(cfg.tokenizer_dir)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    train = TokenStream.build(corpus_texts(cfg.corpus, "train", cfg.max_files), tok, tok.eos_token_id)
    held = None
    if cfg.corpus == "stdlib":
        held = TokenStream.build(corpus_texts("stdlib", "heldout", cfg.max_files), tok, tok.eos_token_id)
    log.info("corpus: %d training tokens, %s held-out", len(train), len(held) if held else "no")

    config = llama_config(cfg.preset, vocab_size=len(tok), eos_id=tok.eos_token_id)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    state_path = out / "train_state.pt"
    start, tokens_seen, elapsed, rng = 0, 0, 0.0, random.Random(cfg.seed)
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start, tokens_seen, elapsed = st["step"], st["tokens_seen"], st["elapsed_s"]
        rng.setstate(st["rng"])
        log.info("resumed at step %d", start)
    with (out / "train_config.json").open("w") as f:
        json.dump(asdict(cfg) | {"n_params": sum(p.numel() for p in model.parameters()),
                                 "train_tokens_available": len(train)}, f, indent=1)
    log_f = (out / "train_log.jsonl").open("a")
    model.train()
    last = None
    long_from = int(cfg.steps * (1 - cfg.long_fraction))
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        if step >= long_from and cfg.long_seq_len > cfg.seq_len:
            bs = max(1, cfg.batch_size * cfg.seq_len // cfg.long_seq_len)
            x = train.batch(rng, bs, cfg.long_seq_len)
        else:
            x = train.batch(rng, cfg.batch_size, cfg.seq_len)
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        elapsed += dt
        tokens_seen += x.numel()
        last = StepLog(step + 1, cfg.steps, loss.item(), lr, tokens_seen, x.numel() / dt, elapsed)
        done = step + 1 == cfg.steps
        if held is not None and ((step + 1) % cfg.eval_every == 0 or done):
            last.eval_loss = eval_loss(model, held, cfg, cfg.eval_batches)
        log_f.write(json.dumps(asdict(last)) + "\n")
        log_f.flush()
        if on_step:
            on_step(last)
        if (step + 1) % cfg.save_every == 0 or done:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                        "tokens_seen": tokens_seen, "elapsed_s": elapsed, "rng": rng.getstate()},
                       str(state_path) + ".tmp")
            Path(str(state_path) + ".tmp").replace(state_path)
    log_f.close()
    save_hf(model, tok, out)
    return last

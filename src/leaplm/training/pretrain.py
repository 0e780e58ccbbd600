"""Pretraining a Llama-architecture causal LM on a code corpus, resumable, saved as a Hugging Face checkpoint.

Mixed precision: bf16 autocast on CPU (about 3x fp32 here), fp32 master weights and AdamW state.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .corpus import TokenStream, corpus_texts
from .loop import Checkpoint, LoopConfig, Schedule, StepLog, StepResult, Trainer, adamw
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
    long_from = int(cfg.steps * (1 - cfg.long_fraction))
    rng = random.Random(cfg.seed)

    def step(i: int) -> StepResult:
        if i >= long_from and cfg.long_seq_len > cfg.seq_len:
            x = train.batch(rng, max(1, cfg.batch_size * cfg.seq_len // cfg.long_seq_len), cfg.long_seq_len)
        else:
            x = train.batch(rng, cfg.batch_size, cfg.seq_len)           # [batch, seq]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = model(input_ids=x, labels=x).loss
        return StepResult(loss, x.numel())

    def evaluate(s: StepLog) -> None:
        s.eval_loss = eval_loss(model, held, cfg, cfg.eval_batches)

    trainer = Trainer(model, adamw(model.parameters(), cfg.lr, cfg.weight_decay),
                      LoopConfig(cfg.steps, Schedule(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps), cfg.grad_clip,
                                 cfg.save_every, cfg.eval_every),
                      step, StepLog, Checkpoint(out / "train_state.pt"), out / "train_log.jsonl", rng,
                      evaluate=evaluate if held is not None else None, on_step=on_step)
    with (out / "train_config.json").open("w") as f:
        json.dump(asdict(cfg) | {"n_params": sum(p.numel() for p in model.parameters()),
                                 "train_tokens_available": len(train)}, f, indent=1)
    last = trainer.run()
    save_hf(model, tok, out)
    return last

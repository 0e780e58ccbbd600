"""The training loop every trainer runs (pretraining, distillation on a corpus or on cached logits, chat
distillation, EAGLE and Medusa heads): AdamW, a linear warm-up then cosine learning rate, gradient clipping,
resumable checkpoints, one JSON log line per step, held-out evaluation every `eval_every` steps and an optional
wall-time limit.

A trainer supplies the model, what one step computes (a batch and its loss: `StepResult`) and the dataclass of its
log line; the loop owns the order of events, identical for all of them:
  1. lr <- schedule(step); the trainer's step draws its batch and returns the loss
  2. a loss that is not finite stops the run before it reaches a checkpoint
  3. backward, clip the gradient norm, optimizer step
  4. the log line (evaluated at eval steps), written, then handed to `on_step`
  5. at save steps, the last step and a reached time limit: the checkpoint, then the trainer's `on_checkpoint`
A rerun with the same checkpoint path resumes: weights, optimizer, step, tokens seen, elapsed time, the Python
RNG and (when given) a torch generator are restored, so a resumed run draws the same batches as an uninterrupted
one. The log is appended to on resume and started afresh otherwise.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Generic, Iterable, TypeVar

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schedule:
    """The learning rate: linear warm-up over `warmup_steps` (step 0 at lr / warmup_steps), then cosine decay
    from `lr` to `min_lr` over the remaining steps of `steps`."""
    lr: float
    min_lr: float
    warmup_steps: int
    steps: int

    def at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        frac = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The optimizer of every trainer: AdamW with betas (0.9, 0.95)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)


@dataclass
class StepLog:
    """One line of train_log.jsonl. Trainers extend it with their own fields (defaults required)."""
    step: int                          # 1-based: the step just taken
    steps: int
    loss: float
    lr: float
    tokens_seen: int
    tokens_per_s: float                # this step's tokens over its own time
    elapsed_s: float                   # wall time of the run so far, earlier runs of a resumed one included
    eval_loss: float | None = None


@dataclass
class StepResult:
    """What a trainer's step returns: the loss to descend and what its log line records beyond the loop's."""
    loss: torch.Tensor                 # [] scalar with a graph to the trained parameters
    tokens: int                        # tokens this step trained on
    fields: dict = field(default_factory=dict)   # the log line's trainer-specific fields


@dataclass(frozen=True)
class LoopConfig:
    steps: int                         # the run's total steps (a resumed run continues up to it)
    schedule: Schedule
    grad_clip: float
    save_every: int
    eval_every: int
    max_minutes: float | None = None   # stop, saving, after this much wall time in this run


class Checkpoint:
    """A resumable state file (written whole under a temporary name, then renamed): the weights under
    `model_key`, the optimizer, the counters, the Python RNG and, when given, a torch generator's state."""

    def __init__(self, path: Path, model_key: str = "model"):
        self.path = Path(path)
        self.model_key = model_key
        self._state: dict | None = None
        self._read = False

    def read(self) -> dict | None:
        """The saved state, or None before the first checkpoint (read once)."""
        if not self._read:
            self._state = torch.load(self.path, weights_only=False) if self.path.exists() else None
            self._read = True
        return self._state

    def write(self, state: dict) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save(state, str(tmp))
        tmp.replace(self.path)


R = TypeVar("R", bound=StepLog)


@dataclass
class Trainer(Generic[R]):
    """One training run. `step(i)` computes step i's loss (i is 0-based); `record` is the log line's dataclass;
    `evaluate(line)` fills its held-out fields; `on_checkpoint(step)` writes what the trainer ships from a
    checkpoint (a draft directory, a head)."""
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    config: LoopConfig
    step: Callable[[int], StepResult]
    record: type[R]
    checkpoint: Checkpoint
    log_path: Path
    rng: random.Random
    generator: torch.Generator | None = None
    evaluate: Callable[[R], None] | None = None
    on_checkpoint: Callable[[int], None] | None = None
    on_step: Callable[[R], None] | None = None

    def run(self) -> R | None:
        """Train from the checkpoint (or from step 0) up to config.steps; the last step's log line, or None when
        there was no step left to take."""
        cfg = self.config
        start, tokens_seen, elapsed0 = self._resume()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if start == 0:
            self.log_path.write_text("")
        t_run = time.perf_counter()
        self.model.train()
        last = None
        with self.log_path.open("a") as log_f:
            for step in range(start, cfg.steps):
                t0 = time.perf_counter()
                lr = cfg.schedule.at(step)
                for g in self.opt.param_groups:
                    g["lr"] = lr
                r = self.step(step)
                if not torch.isfinite(r.loss):
                    raise FloatingPointError(f"step {step + 1}: the loss is {r.loss.item()}; stopped before the "
                                             f"checkpoint (the last one is in {self.checkpoint.path.parent})")
                self.opt.zero_grad(set_to_none=True)
                r.loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                tokens_seen += r.tokens
                now = time.perf_counter()
                last = self.record(step=step + 1, steps=cfg.steps, loss=r.loss.item(), lr=lr,
                                   tokens_seen=tokens_seen, tokens_per_s=r.tokens / (now - t0),
                                   elapsed_s=elapsed0 + now - t_run, **r.fields)
                done = step + 1 == cfg.steps
                if self.evaluate is not None and ((step + 1) % cfg.eval_every == 0 or done):
                    self.evaluate(last)
                log_f.write(json.dumps(asdict(last)) + "\n")
                log_f.flush()
                if self.on_step:
                    self.on_step(last)
                over = cfg.max_minutes is not None and time.perf_counter() - t_run > 60 * cfg.max_minutes
                if (step + 1) % cfg.save_every == 0 or done or over:
                    self._save(step + 1, tokens_seen, elapsed0 + time.perf_counter() - t_run)
                if over:
                    log.info("stopping at step %d: %.1f minutes reached", step + 1, cfg.max_minutes)
                    break
        return last

    def _resume(self) -> tuple[int, int, float]:
        st = self.checkpoint.read()
        if st is None:
            return 0, 0, 0.0
        self.model.load_state_dict(st[self.checkpoint.model_key])
        self.opt.load_state_dict(st["opt"])
        self.rng.setstate(st["rng"])
        if self.generator is not None:
            self.generator.set_state(st["gen"])
        log.info("resumed at step %d", st["step"])
        return st["step"], st["tokens_seen"], st["elapsed_s"]

    def _save(self, step: int, tokens_seen: int, elapsed: float) -> None:
        state = {self.checkpoint.model_key: self.model.state_dict(), "opt": self.opt.state_dict(), "step": step,
                 "tokens_seen": tokens_seen, "elapsed_s": elapsed, "rng": self.rng.getstate()}
        if self.generator is not None:
            state["gen"] = self.generator.get_state()
        self.checkpoint.write(state)
        if self.on_checkpoint:
            self.on_checkpoint(step)

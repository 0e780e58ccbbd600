"""The training loop every trainer runs (training/loop.py): the learning-rate schedule against a plain reference,
a resumed run equal to an uninterrupted one, a non-finite loss stopped before the checkpoint, the wall-time
limit, and the log started afresh only when there is nothing to resume."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

import pytest
import torch

from leaplm.training.loop import Checkpoint, LoopConfig, Schedule, StepLog, StepResult, Trainer, adamw


def reference_lr(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """Slow and obvious: warm-up from lr / warmup to lr, then half a cosine period from lr to min_lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + (lr - min_lr) * (math.cos(math.pi * t) + 1) / 2


@pytest.mark.parametrize("warmup,steps", [(1, 1), (3, 10), (10, 10), (20, 5), (4, 200)])
def test_schedule_is_warmup_then_cosine(warmup, steps):
    s = Schedule(lr=2e-3, min_lr=1e-4, warmup_steps=warmup, steps=steps)
    got = [s.at(i) for i in range(steps + 3)]
    assert got == pytest.approx([reference_lr(i, 2e-3, 1e-4, warmup, steps) for i in range(steps + 3)], rel=1e-12)
    assert max(got) <= 2e-3 and min(got) >= 1e-4
    if steps > warmup:
        assert s.at(warmup) == pytest.approx(2e-3) and s.at(steps) == pytest.approx(1e-4)


@dataclass
class ToyLog(StepLog):
    x0: float = 0.0             # the first input of the step's batch (the batches must match too)


def toy_trainer(tmp_path, steps: int, on_step=None, loss_at=None, max_minutes=None, save_every: int = 2):
    """A linear model on seeded random batches drawn from both the Python RNG and a torch generator."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    rng, gen = random.Random(5), torch.Generator().manual_seed(7)

    def step(i: int) -> StepResult:
        x = torch.randn(8, 4, generator=gen) * rng.uniform(0.5, 2.0)        # [batch, 4]
        loss = ((model(x).squeeze(-1) - x.sum(-1)) ** 2).mean()
        # the toy's own loss is finite on finite inputs and weights; if it is not, the process's arithmetic is at
        # fault (not the loop under test): say what each part was
        assert torch.isfinite(loss), dict(step=i, x=x.tolist(), weight=model.weight.tolist(), bias=model.bias.tolist(),
                                          out=model(x).tolist(), by_hand=(x @ model.weight.detach().t()).tolist())
        if loss_at is not None:
            loss = loss * loss_at(i)
        return StepResult(loss, 8, dict(x0=float(x[0, 0])))

    cfg = LoopConfig(steps, Schedule(0.05, 0.005, 2, steps), grad_clip=1.0, save_every=save_every, eval_every=3,
                     max_minutes=max_minutes)
    return Trainer(model, adamw(model.parameters(), 0.05, 0.01), cfg, step, ToyLog,
                   Checkpoint(tmp_path / "state.pt"), tmp_path / "log.jsonl", rng, generator=gen,
                   evaluate=lambda s: setattr(s, "eval_loss", -1.0), on_step=on_step), model


def _losses(logs):
    return [(s.step, s.loss, s.lr, s.x0, s.eval_loss) for s in logs]


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    whole, part = [], []
    trainer, model = toy_trainer(tmp_path / "a", 7, whole.append)
    trainer.run()
    weights = [p.detach().clone() for p in model.parameters()]

    trainer, _ = toy_trainer(tmp_path / "b", 7, part.append)
    stop_at = 4

    class Stop(Exception):
        pass

    def interrupt(s):
        part.append(s)
        if s.step == stop_at + 1:                     # after the checkpoint at 4: step 5 is lost and redone
            raise Stop

    trainer.on_step = interrupt
    with pytest.raises(Stop):
        trainer.run()
    part.pop()                                        # the lost step
    trainer, model = toy_trainer(tmp_path / "b", 7, part.append)
    assert trainer.run().step == 7
    assert _losses(part) == _losses(whole)            # exactly: the same batches, learning rates and weights
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    lines = [json.loads(x)["step"] for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3, 4, 5, 5, 6, 7]          # appended on resume, the lost step logged twice
    assert [s.eval_loss for s in whole] == [None, None, -1.0, None, None, -1.0, -1.0]
    # a finished run has nothing left to do
    assert toy_trainer(tmp_path / "b", 7)[0].run() is None


def test_a_fresh_run_starts_its_log_afresh(tmp_path):
    (tmp_path / "log.jsonl").write_text('{"step": 99}\n')
    toy_trainer(tmp_path, 2)[0].run()
    assert [json.loads(x)["step"] for x in (tmp_path / "log.jsonl").read_text().splitlines()] == [1, 2]


def test_a_non_finite_loss_stops_before_the_checkpoint(tmp_path):
    trainer, _ = toy_trainer(tmp_path, 6, loss_at=lambda i: float("nan") if i == 3 else 1.0)
    with pytest.raises(FloatingPointError, match="step 4: the loss is nan"):
        trainer.run()
    assert torch.load(tmp_path / "state.pt", weights_only=False)["step"] == 2
    # negative control: the same run with a finite loss goes past step 4
    assert toy_trainer(tmp_path / "ok", 6)[0].run().step == 6


def test_the_time_limit_stops_and_saves(tmp_path):
    seen = []
    trainer, _ = toy_trainer(tmp_path, 6, seen.append, max_minutes=0.0, save_every=100)
    assert trainer.run().step == 1
    assert torch.load(tmp_path / "state.pt", weights_only=False)["step"] == 1

"""`leaplm train eagle` and `leaplm train medusa`: training draft heads on the frozen target (mounted on
cli/train.py's train_app). Rendering only; the recipes live in training/eagle.py and training/medusa.py."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from ..training.eagle import EagleTrainConfig
from .common import StepProgress, out, setup_training, user_errors
from .train import Threads, acceptance_rows, train_app
from .train_options import HEAD_RUN, LOOP


def _e(name: str, help: str, **kw):
    return typer.Option({f.name: f.default for f in dataclasses.fields(EagleTrainConfig)}[name], help=help, **kw)


def _check_target(value: str) -> str:
    p = Path(value)
    if not (p / "config.json").exists() and not (p.is_file() and p.suffix == ".gguf"):
        raise typer.BadParameter(f"{value!r} is neither a checkpoint directory (config.json) nor a .gguf file")
    return value


class HeadProgress(StepProgress):
    """The training bar, plus each held-out evaluation: acceptance 1 - TV(p, q) per drafted position."""

    def __call__(self, s) -> None:
        super().__call__(s)
        if s.eval_accept is not None:
            acc = ", ".join(f"{a:.3f}" for a in s.eval_accept)
            self.progress.console.log(f"  held-out acceptance by draft position: {acc}")


TARGET = typer.Option(..., "--target", callback=_check_target, help="The target: checkpoint directory or .gguf file.")
OUT = typer.Option(..., "--out", help="Head directory (rerun to resume from its checkpoint).")
TEMPERATURES = typer.Option("0,0.8,1.0", help="Generation temperatures, cycled per batch (0 = greedy).")


@train_app.command("eagle")
@LOOP.options(EagleTrainConfig, into="loop")
@HEAD_RUN.options(EagleTrainConfig, into="run")
def eagle_cmd(
    target_dir: str = TARGET,
    out_dir: Path = OUT,
    temperatures: str = TEMPERATURES,
    unroll: int = _e("unroll", "Training-time-test passes (draft positions trained).", min=1, max=8),
    intermediate_size: Optional[int] = typer.Option(None, min=1, help="Head MLP width (default: the target's)."),
    chat: bool = typer.Option(False, "--chat", help="Prompts are user messages through the target's chat "
                              "template (stdlib: leaplm's chat prompts from the training split; or a .jsonl with "
                              "'prompt'); --prompt-tokens is then the longest prompt kept; loss on answers only."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", min=1, help="Reduced draft vocabulary: the "
                                              "head's own output layer over the N tokens the target says most."),
    threads: Optional[int] = Threads,
    run: dict = None,
    loop: dict = None,
) -> None:
    """Train an EAGLE head on the frozen target by self-distillation on its own greedy and sampled text."""
    from ..training.eagle import train_eagle

    temps = _temps(temperatures)
    setup_training(threads)
    cfg = EagleTrainConfig(target_dir=target_dir, out_dir=str(out_dir), temperatures=temps, unroll=unroll,
                           intermediate_size=intermediate_size, chat=chat, draft_vocab=draft_vocab, **run, **loop)
    with user_errors([f.name for f in dataclasses.fields(cfg)]), HeadProgress("train eagle") as bar:
        last = train_eagle(cfg, bar)
    _done(out_dir, cfg.steps, last)


@train_app.command("medusa")
@LOOP.options(EagleTrainConfig, into="loop")
@HEAD_RUN.options(EagleTrainConfig, into="run")
def medusa_cmd(
    target_dir: str = TARGET,
    out_dir: Path = OUT,
    heads: int = _e("medusa_heads", "Medusa heads (draft depth).", min=1, max=8),
    temperatures: str = TEMPERATURES,
    threads: Optional[int] = Threads,
    run: dict = None,
    loop: dict = None,
) -> None:
    """Train Medusa-1 heads on the frozen target by self-distillation on its own greedy and sampled text."""
    from ..training.eagle import train_eagle

    temps = _temps(temperatures)
    setup_training(threads)
    cfg = EagleTrainConfig(target_dir=target_dir, out_dir=str(out_dir), temperatures=temps, kind="medusa",
                           medusa_heads=heads, **run, **loop)
    with user_errors([f.name for f in dataclasses.fields(cfg)]), HeadProgress("train medusa") as bar:
        last = train_eagle(cfg, bar)
    _done(out_dir, cfg.steps, last)


@train_app.command("export-head")
def export_cmd(
    head: Path = typer.Option(..., "--head", help="A leaplm EAGLE head directory (from `leaplm train eagle`)."),
    target_dir: str = typer.Option(..., "--target", callback=_check_target, help="The head's target."),
    out_dir: Path = typer.Option(..., "--out", help="Directory to write."),
    layout: str = typer.Option("speculators", help="speculators (vLLM, speculators) | eagle (EAGLE's repos)."),
    speculative_tokens: int = typer.Option(5, min=1, help="Speculators: proposal_methods' speculative_tokens."),
) -> None:
    """Export an EAGLE head to the Speculators layout (vLLM's --speculative-config '{"model": OUT,
    "method": "eagle"}') or to the original EAGLE repositories' layout."""
    from ..heads.formats import export_head
    from ..models.loading import load_model

    with user_errors(["head", "layout", "target_dir"]):
        target = load_model(target_dir, field="target_dir", backend="torch")
        export_head(head, out_dir, target, layout, speculative_tokens)
    out.print(f"wrote {layout} layout to {out_dir}")


@train_app.command("ship-head")
def ship_cmd(
    head: Path = typer.Option(..., "--head", help="A trained head directory (from `leaplm train eagle/medusa`)."),
    out_dir: Path = typer.Option(..., "--out", help="Directory to write (src/leaplm/embedded/NAME to ship it)."),
    acceptance: Optional[Path] = typer.Option(None, exists=True, dir_okay=False, help="JSON rows for the card's "
                                              "acceptance table (`leaplm eval acceptance --method eagle --json`)."),
    command: Optional[str] = typer.Option(None, help="The training command, for the card."),
) -> None:
    """Store a trained head in bfloat16 with its log, config and card (loss and acceptance curves, acceptance
    table): what ships in the package."""
    from ..training.ship_head import ship_head

    with user_errors(["head"]):
        ship_head(head, out_dir, acceptance_rows(acceptance), command)
    out.print(f"shipped {head} to {out_dir}")


def _temps(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of numbers",
                                 param_hint="--temperatures") from None


def _done(out_dir: Path, steps: int, last) -> None:
    if last is None:
        out.print(f"nothing to do: {out_dir} already finished its {steps} steps (raise --steps to continue)")
        return
    out.print(f"done: step {last.step}/{last.steps}, loss {last.loss:.4f}; head in {out_dir}")

"""What every command shares: the consoles, errors (`fail`, library errors as usage errors), progress bars and
the torch thread setting. Commands print through these consoles; the library never prints."""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from ..config import ConfigError

err = Console(stderr=True)        # errors, progress and summaries
out = Console()                   # results on stdout
wide = Console(width=160)         # result tables on stdout (not wrapped at the terminal's width)


def write(text: str) -> None:
    """Generated text to stdout as it is (no wrapping, no markup)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def fail(message: str, code: int = 2) -> None:
    """A usage error: `error: MESSAGE` on stderr, exit code 2. MESSAGE starts with the option it is about."""
    err.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


def flag(field: str) -> str:
    """A ConfigError's field -> the option the user typed (max_model_len -> --max-model-len)."""
    return "--" + field.replace("_", "-")


def fail_config(e: ConfigError, flags: dict[str, str] | None = None) -> None:
    """fail() for a ConfigError, naming its option (`flags` maps fields whose option is spelled otherwise)."""
    fail(f"{(flags or {}).get(e.field) or flag(e.field)}: {e.message}")


def set_threads(threads: Optional[int]) -> None:
    if threads is not None:
        if threads < 1:
            fail("--threads: must be >= 1")
        import torch

        torch.set_num_threads(threads)


def setup_training(threads: int | None) -> None:
    """Training commands: torch threads, and the library's INFO log lines rendered by rich on stderr."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    if not logging.getLogger().handlers:
        from rich.logging import RichHandler

        logging.basicConfig(level=logging.INFO, format="%(message)s",
                            handlers=[RichHandler(console=err, show_path=False)])


def option_name(field: str) -> str:
    """A training config field -> its option (out_dir -> --out)."""
    return "--" + {"out_dir": "out", "tokenizer_dir": "tokenizer", "target_dir": "target",
                   "draft_init": "draft-init"}.get(field, field).replace("_", "-")


@contextmanager
def user_errors(fields: list[str]) -> Iterator[None]:
    """Bad input raised by the library becomes a usage error naming the option (exit 2), not a traceback.

    ConfigError names its field; other ValueErrors from the recipes start with the field name by convention."""
    try:
        yield
    except ConfigError as e:
        raise typer.BadParameter(e.message, param_hint=option_name(e.field)) from None
    except (ValueError, FileNotFoundError) as e:
        msg = str(e)
        head = msg.split(" ", 1)[0].rstrip(":")
        if head in fields:
            raise typer.BadParameter(msg.split(" ", 1)[1].lstrip(": ") if " " in msg else msg,
                                     param_hint=option_name(head)) from None
        err.print(f"[bold red]error:[/] {msg}")
        raise typer.Exit(2) from None


def counter(label: str) -> Progress:
    """A bar for work counted in items (sequences, answers): done/total, elapsed, remaining."""
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err)


class StepProgress:
    """An on_step callback drawing a progress bar with loss and tokens/s; logs each held-out evaluation."""

    def __init__(self, title: str):
        self.title = title
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=err)
        self.task = None
        self.tps: float | None = None

    def __enter__(self) -> "StepProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def __call__(self, s) -> None:
        if self.task is None:  # created on the first step so a resumed run starts the bar where it left off
            self.task = self.progress.add_task(self.title, total=s.steps, completed=s.step - 1, loss="-", tps="-")
        self.tps = s.tokens_per_s if self.tps is None else 0.9 * self.tps + 0.1 * s.tokens_per_s
        self.progress.update(self.task, completed=s.step, loss=f"{s.loss:.3f}", tps=f"{self.tps:,.0f}")
        if s.eval_loss is not None:
            kl = getattr(s, "eval_kl", None)
            extra = f", held-out KL {kl:.4f}" if kl is not None else ""
            agree = getattr(s, "eval_agree", None)
            extra += f", greedy agreement {agree:.3f}" if agree is not None else ""
            overlap = getattr(s, "eval_overlap", None)
            extra += f", sampled overlap {overlap:.3f}" if overlap is not None else ""
            self.progress.console.log(f"step {s.step}/{s.steps}: train {s.loss:.4f}, held-out CE {s.eval_loss:.4f}"
                                      f"{extra}, {s.tokens_seen:,} tokens")

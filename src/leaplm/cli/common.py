"""What every command shares: the consoles, errors (`fail`, library errors as usage errors), progress bars, the
torch thread setting, and EngineOptions: the options of every command that builds an engine, declared once.
Commands print through these consoles; the library never prints."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
import typing
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import typer
from rich.console import Console

from ..config import ConfigError, EngineConfig

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


def counter(label: str):
    """A bar for work counted in items (sequences, answers): done/total, elapsed, remaining (a rich Progress)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err)


class StepProgress:
    """An on_step callback drawing a progress bar with loss and tokens/s; logs each held-out evaluation."""

    def __init__(self, title: str):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

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


# ---- the options of every command that builds an engine --------------------------------------------------------

def _option(default, *names: str, help: str):
    """An EngineOptions field: its default and the typer option that sets it."""
    return dataclasses.field(default=default, metadata={"option": typer.Option(default, *names, help=help)})


@dataclasses.dataclass
class EngineOptions:
    """The options of every command that builds an engine (generate, serve, bench, tune). A command declares them
    once with @engine_options and receives them as one argument, `options: EngineOptions`.

    A new option is one field here: every engine command then takes it, except those that list it in their
    `without=` (a command that cannot honour an option does not offer it, rather than ignore it)."""
    model: Optional[str] = _option(None, "--model", "-m", help="Target: a local Hugging Face checkpoint directory, "
                                   "a .gguf file, or a hub id (default: the embedded model).")
    dtype: str = _option("float32", "--dtype", help="float32|bfloat16|float16|auto (auto: the checkpoint's dtype).")
    quantization: Optional[str] = _option(None, "--quantization", help="Weight-only quantization of target and "
                                          "draft: int8 | int4 (blocks of 32, quantized at load) | gguf (a GGUF "
                                          "file's own blocks: Q8_0, Q5_0, Q4_0, Q4_1, Q4_K, Q6_K). Default: none.")
    kv_cache_dtype: str = _option("auto", "--kv-cache-dtype", help="KV-cache dtype: auto (the model's)|float32|"
                                  "bfloat16|float16.")
    max_model_len: Optional[int] = _option(None, "--max-model-len", "-c", "--ctx-size", help="Context (prompt + "
                                           "output) per request (default: min(the model's, 4096)).")
    device: str = _option("cpu", "--device", help="Target device: cpu|cuda|cuda:N|mps.")
    threads: Optional[int] = _option(None, "--threads", "-t", help="torch CPU threads (default: torch's choice).")
    backend: str = _option("auto", "--backend", help="What runs a GGUF model's forwards: auto (libllama when the "
                           "llamacpp extra is installed, see docs/backends.md) | llamacpp | torch.")
    recalibrate: bool = _option(False, "--recalibrate", help="Measure the start-up checks again (cost "
                                "calibration, thread check, batch invariance, SIMD path) instead of reading them from "
                                "the start-up cache (docs/startup.md).")

    def engine_config(self, **settings) -> EngineConfig:
        """The EngineConfig these options and the command's own settings (draft, method, k, head, spec_options,
        draft_device, max_num_batched_tokens, or a field here overridden) make: what the engine is built from."""
        engine = {f.name for f in dataclasses.fields(EngineConfig)}     # recalibrate is the start-up cache's
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in engine}
        return EngineConfig(**{**mine, **settings})


def engine_options(*, without: tuple[str, ...] = ()) -> Callable:
    """Decorate a command taking `options: EngineOptions`: its command line gets every EngineOptions option except
    those in `without` (which keep their defaults), and the values arrive as that one argument."""
    fields = {f.name: f for f in dataclasses.fields(EngineOptions)}
    unknown = set(without) - set(fields)
    if unknown:
        raise ValueError(f"without: no EngineOptions field {sorted(unknown)}")
    types = typing.get_type_hints(EngineOptions)
    taken = [name for name in fields if name not in without]

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "options"]
        if len(own) == len(sig.parameters):
            raise TypeError(f"{fn.__name__}: a command with @engine_options takes `options: EngineOptions`")
        clash = set(taken) & {p.name for p in own}
        if clash:
            raise TypeError(f"{fn.__name__}: declares {sorted(clash)}, which EngineOptions declares")
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=fields[name].metadata["option"],
                                   annotation=types[name]) for name in taken]

        @functools.wraps(fn)
        def command(*args, **kwargs):
            options = EngineOptions(**{name: kwargs.pop(name) for name in taken})
            if options.recalibrate:
                from ..startup_cache import set_recalibrate

                set_recalibrate(True)
            return fn(*args, options=options, **kwargs)

        # the command's arguments, then the engine's options (what runs), then the command's own options
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        arguments = [p for p in own if isinstance(p.default, typer.models.ArgumentInfo)]
        params = arguments + added + [p for p in own if p not in arguments]
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not p.empty}
        return command

    return wrap


# ---- speculation options that generate and serve share (vLLM's and llama.cpp's spellings: cli/aliases.py) -------
DRAFT = typer.Option(None, "--draft", "--speculative-model", "-md", "--model-draft",
                     help="Draft model for --method draft: a path, hub id or shipped draft's name (smollm2-draft, "
                          "draft-3m; `leaplm models` lists them). Default: the shipped draft for the target.")
K = typer.Option(5, "--k", "-k", "--num-speculative-tokens", "--draft-max",
                 help="Most speculative tokens per step (tree nodes for tree methods); measured costs may lower it.")
SPECULATIVE_CONFIG = typer.Option(None, "--speculative-config", help="vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                                  "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' or "
                                  "'{\"model\": DRAFT}'.")
DRAFT_MIN = typer.Option(None, "--draft-min", hidden=True)                      # llama.cpp's: refused
N_GPU_LAYERS = typer.Option(None, "-ngl", "--n-gpu-layers", "--gpu-layers", hidden=True)   # llama.cpp's: 0 accepted
ADAPTIVE_K = typer.Option(True, "--adaptive-k/--fixed-k", help="Let measured costs lower K per step.")

"""leaplm's command line (the only package that imports typer): one module per command group.

generate.py        leaplm generate (startup.py: its --startup report)
serve.py           leaplm serve (and python -m leaplm.server)
bench.py           leaplm bench, bench memory; bench_serve.py, bench_roofline.py and bench_llamacpp.py: bench serve,
                   bench --roofline, bench --baselines llamacpp; bench_project.py: bench project;
                   bench_agree.py: bench agree
tune.py            leaplm tune
train.py           leaplm train tokenizer|pretrain|distill|ondata|card; heads.py: train eagle|medusa|export-head|
                   ship-head; train_chat.py: train chatdata|distill-chat
evaluate.py        leaplm eval perplexity|acceptance
models.py          leaplm models, models fetch, models export-gguf; synth.py: models synth
aliases.py         the spellings vLLM and llama.cpp users type, mapped onto leaplm's options
common.py          consoles, errors, progress bars, torch threads

`leaplm generate` and `leaplm serve` start on a command line of their own command alone (App.__call__), so they
import neither training, benchmarks, tuning nor plotting; everything else (`leaplm --help`, the other commands,
typer's test runner) sees every command, added on first use (App.registered_commands).
"""
from __future__ import annotations

import gc
import sys

import typer

HELP = "Lossless speculative decoding for Hugging Face causal LMs."
LEAN = ("generate", "serve")      # commands that run on a command line of their own when leaplm runs as a program


def add_commands(app: typer.Typer, only: str | None = None) -> None:
    """Add leaplm's commands to `app`: every one, or only `only` (one of LEAN)."""
    if only == "generate":
        from .generate import generate

        app.command("generate")(generate)
        return
    if only == "serve":
        from .serve import serve

        app.command("serve")(serve)
        return
    # heads and train_chat add their commands to train's group when imported
    from . import (bench, bench_agree, bench_project, bench_serve, evaluate, generate, heads, models, serve,  # noqa: F401
                   synth, train, train_chat, tune)

    app.command("generate")(generate.generate)
    app.command("serve")(serve.serve)
    bench.bench_app.command("serve")(bench_serve.bench_serve)
    bench.bench_app.command("project")(bench_project.bench_project)
    bench.bench_app.command("agree")(bench_agree.bench_agree)
    app.add_typer(bench.bench_app, name="bench")
    app.command("tune")(tune.tune)
    models.models_app.command("synth")(synth.synth)
    app.add_typer(models.models_app, name="models")
    app.add_typer(train.train_app, name="train", help="Train the tokenizer, pretrain and distill models.")
    app.add_typer(evaluate.eval_app, name="eval", help="Evaluate perplexity and draft acceptance.")


def _group() -> None:
    """Lossless speculative decoding for Hugging Face causal LMs."""


class App(typer.Typer):
    """The `leaplm` command line: its commands are added the first time anything reads them."""

    def __init__(self, **kw):
        self._complete = False
        super().__init__(**kw)

    def __call__(self, *args, **kwargs):
        name = sys.argv[1] if len(sys.argv) > 1 else None
        if name in LEAN and not args and "args" not in kwargs:     # run as a program: `leaplm generate ...`
            lean = typer.Typer(add_completion=False, help=HELP)
            lean.callback()(_group)                                 # a group, so the command keeps its name
            add_commands(lean, name)
            try:
                return lean(**kwargs)
            finally:
                # the process ends here: the collector's last pass at exit walks every object torch and the model
                # made (about 0.4 s on a 2-core machine) to free nothing the exit does not; frozen, it skips them
                gc.freeze()
        return super().__call__(*args, **kwargs)

    def _ensure_commands(self) -> None:
        if not self._complete:
            self._complete = True
            add_commands(self)

    @property
    def registered_commands(self) -> list:
        self._ensure_commands()
        return self._commands

    @registered_commands.setter
    def registered_commands(self, value: list) -> None:
        self._commands = value

    @property
    def registered_groups(self) -> list:
        self._ensure_commands()
        return self._groups

    @registered_groups.setter
    def registered_groups(self, value: list) -> None:
        self._groups = value


app = App(add_completion=False, no_args_is_help=True, help=HELP)

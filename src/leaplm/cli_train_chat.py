"""`leaplm train chatdata`: chat distillation data for any target (training/chat_ondata.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
    TimeRemainingColumn

from .cli_train import Threads, _setup, _user_errors, err, out, train_app
from .training.chat_ondata import ChatDataConfig


def _d(name: str):
    return {f.name: f.default for f in dataclasses.fields(ChatDataConfig)}[name]


@train_app.command("chatdata")
def chatdata_cmd(
    model: str = typer.Option(..., "--model", help="Target: a GGUF file, a checkpoint directory or a fetched "
                                                   "model's name (`leaplm models`)."),
    out_dir: Path = typer.Option(..., "--out", help="Shard directory (rerun to resume)."),
    n_prompts: int = typer.Option(_d("n_prompts"), "--n-prompts", min=1, help="Answers to generate."),
    new_tokens: int = typer.Option(_d("new_tokens"), "--new-tokens", min=1, help="Longest answer kept."),
    top_k: int = typer.Option(_d("top_k"), "--top-k", min=1, max=20, help="Target log-probs kept per token."),
    batch_size: int = typer.Option(_d("batch_size"), "--batch-size", min=1, help="Rows decoded together."),
    shard_rows: int = typer.Option(_d("shard_rows"), "--shard-rows", min=1, help="Rows per shard file."),
    temperatures: str = typer.Option("0,0.8", "--temperatures",
                                     help="Comma list; shards cycle through them (0 = greedy)."),
    max_prompt_tokens: int = typer.Option(_d("max_prompt_tokens"), "--max-prompt-tokens", min=1,
                                          help="Skip chat prompts longer than this (templated)."),
    seed: int = typer.Option(0),
    max_files: Optional[int] = typer.Option(None, min=1, help="Scan only the first N stdlib files (tests)."),
    threads: Optional[int] = Threads,
) -> None:
    """The target's own chat answers (greedy and sampled) to prompts derived from the standard library, with
    its top-k log-probs, as shards for `train distill --logits-dir`."""
    from .models.catalog import resolve_model_name
    from .training.chat_ondata import generate_chat_logits

    _setup(threads)
    try:
        temps = tuple(float(x) for x in temperatures.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("expected comma-separated numbers", param_hint="--temperatures") from None
    cfg = ChatDataConfig(model=resolve_model_name(model), out_dir=str(out_dir), n_prompts=n_prompts,
                         new_tokens=new_tokens, top_k=top_k, batch_size=batch_size, shard_rows=shard_rows,
                         temperatures=temps, max_prompt_tokens=max_prompt_tokens, seed=seed, max_files=max_files)
    with _user_errors([f.name for f in dataclasses.fields(cfg)]), \
            Progress(TextColumn("chat answers"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     TimeRemainingColumn(), console=err) as prog:
        task = prog.add_task("gen", total=n_prompts)
        rows = generate_chat_logits(cfg, on_rows=lambda d, n: prog.update(task, completed=d, total=n))
    out.print(f"{rows} answers in {out_dir}")

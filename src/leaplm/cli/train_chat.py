"""`leaplm train chatdata` and `leaplm train distill-chat`: chat distillation data for any target
(training/chat_ondata.py) and a small draft distilled from it (training/chat_distill.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from ..training.chat_ondata import ChatDataConfig
from .common import StepProgress, counter, out, setup_training, user_errors
from .train import Threads, report_done, train_app


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
    from ..models.catalog import resolve_model_name
    from ..training.chat_ondata import generate_chat_logits

    setup_training(threads)
    try:
        temps = tuple(float(x) for x in temperatures.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("expected comma-separated numbers", param_hint="--temperatures") from None
    cfg = ChatDataConfig(model=resolve_model_name(model), out_dir=str(out_dir), n_prompts=n_prompts,
                         new_tokens=new_tokens, top_k=top_k, batch_size=batch_size, shard_rows=shard_rows,
                         temperatures=temps, max_prompt_tokens=max_prompt_tokens, seed=seed, max_files=max_files)
    with user_errors([f.name for f in dataclasses.fields(cfg)]), \
            counter("chat answers") as prog:
        task = prog.add_task("gen", total=n_prompts)
        rows = generate_chat_logits(cfg, on_rows=lambda d, n: prog.update(task, completed=d, total=n))
    out.print(f"{rows} answers in {out_dir}")


def _dd(name: str):
    from ..training.chat_distill import ChatDistillConfig

    return {f.name: f.default for f in dataclasses.fields(ChatDistillConfig)}[name]


@train_app.command("distill-chat")
def distill_chat_cmd(
    model: str = typer.Option(..., "--model", help="The target (GGUF file, checkpoint directory or catalog name): "
                                                   "its tokenizer and embedding."),
    logits_dir: Path = typer.Option(..., "--logits-dir", help="Shards written by `train chatdata`."),
    out_dir: Path = typer.Option(..., "--out", help="Run and draft directory (rerun to resume)."),
    shape: str = typer.Option(_dd("shape"), help="Draft shape (training/chat_distill.py DRAFT_SHAPES)."),
    draft_vocab: int = typer.Option(_dd("draft_vocab"), "--draft-vocab", min=2,
                                    help="Draft vocabulary rows: the target tokens with most mass, + 1 'other'."),
    steps: int = typer.Option(_dd("steps"), min=1),
    batch_size: int = typer.Option(_dd("batch_size"), "--batch-size", min=1, help="Answers per step."),
    alpha: float = typer.Option(_dd("alpha"), min=0.0, max=1.0, help="Loss = alpha * KL + (1 - alpha) * CE."),
    temperatures: str = typer.Option("1.0,0.8", "--temperatures", help="KL averaged over these temperatures."),
    lr: float = typer.Option(_dd("lr"), min=0.0),
    warmup_steps: int = typer.Option(_dd("warmup_steps"), "--warmup-steps", min=1),
    eval_every: int = typer.Option(_dd("eval_every"), "--eval-every", min=1),
    save_every: int = typer.Option(_dd("save_every"), "--save-every", min=1),
    text_weight: float = typer.Option(_dd("text_weight"), "--text-weight", min=0.0,
                                      help="Add this times next-token CE on --text-corpus (no target needed)."),
    text_corpus: str = typer.Option(_dd("text_corpus"), "--text-corpus",
                                    help="'stdlib', a directory of .py files, or a .jsonl file."),
    seed: int = typer.Option(0),
    threads: Optional[int] = Threads,
) -> None:
    """Distil a small reduced-vocabulary draft for any target from its chat shards; resumes from --out."""
    from ..models.catalog import resolve_model_name
    from ..training.chat_distill import ChatDistillConfig, distill_chat

    setup_training(threads)
    try:
        temps = tuple(float(x) for x in temperatures.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("expected comma-separated numbers", param_hint="--temperatures") from None
    with user_errors(["model", "logits_dir", "shape", "draft_vocab", "temperatures", "text_corpus"]):
        cfg = ChatDistillConfig(model=resolve_model_name(model), logits_dir=str(logits_dir), out_dir=str(out_dir),
                                shape=shape, draft_vocab=draft_vocab, steps=steps, batch_size=batch_size,
                                alpha=alpha, temperatures=temps, lr=lr, warmup_steps=warmup_steps,
                                eval_every=eval_every, save_every=save_every, seed=seed, text_weight=text_weight,
                                text_corpus=text_corpus)
        with StepProgress(f"distill-chat {shape}") as bar:
            last = distill_chat(cfg, bar)
    report_done(out_dir, last)


"""`leaplm train chatdata`, `leaplm train distill-chat` and `leaplm train draft`: chat distillation data for any
target (training/chat_ondata.py), a small draft distilled from it (training/chat_distill.py), and both in one
resumable run (training/draft_run.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from ..training.chat_distill import ChatDistillConfig
from ..training.chat_ondata import ChatDataConfig
from .common import StepProgress, counter, out, setup_training, user_errors
from .train import Threads, report_done, train_app
from .train_options import LOOP


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
    prompts: str = typer.Option(_d("prompts"), "--prompts",
                                help="chat (chat answers through the chat template) or text (a base model's "
                                     "continuations of code and prose)."),
    backend: str = typer.Option(_d("backend"), "--backend",
                                help="auto (libllama for a GGUF file when llama-cpp-python is installed), llamacpp "
                                     "or engine (leaplm's batched engine)."),
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
                         temperatures=temps, max_prompt_tokens=max_prompt_tokens, seed=seed, max_files=max_files,
                         backend=backend, threads=threads, prompts=prompts)
    with user_errors([f.name for f in dataclasses.fields(cfg)]), \
            counter(f"{prompts} answers") as prog:
        task = prog.add_task("gen", total=n_prompts)
        rows = generate_chat_logits(cfg, on_rows=lambda d, n: prog.update(task, completed=d, total=n))
    out.print(f"{rows} answers in {out_dir}")


def _dd(name: str):
    return {f.name: f.default for f in dataclasses.fields(ChatDistillConfig)}[name]


@train_app.command("distill-chat")
@LOOP.options(ChatDistillConfig, into="loop")
def distill_chat_cmd(
    model: str = typer.Option(..., "--model", help="The target (GGUF file, checkpoint directory or catalog name): "
                                                   "its tokenizer and embedding."),
    logits_dir: Path = typer.Option(..., "--logits-dir", help="Shards written by `train chatdata`."),
    out_dir: Path = typer.Option(..., "--out", help="Run and draft directory (rerun to resume)."),
    shape: str = typer.Option(_dd("shape"), help="Draft shape (training/chat_draft_init.py DRAFT_SHAPES)."),
    draft_vocab: int = typer.Option(_dd("draft_vocab"), "--draft-vocab", min=2,
                                    help="Draft vocabulary rows: the target tokens with most mass, + 1 'other'."),
    steps: int = typer.Option(_dd("steps"), min=1),
    batch_size: int = typer.Option(_dd("batch_size"), "--batch-size", min=1, help="Answers per step."),
    alpha: float = typer.Option(_dd("alpha"), min=0.0, max=1.0,
                                help="Loss = alpha * divergence + (1 - alpha) * CE."),
    loss: str = typer.Option(_dd("loss"), help="Divergence: kl (forward KL) or tv (total variation, what sampled "
                                               "acceptance pays for)."),
    temperatures: str = typer.Option("1.0,0.8", "--temperatures",
                                     help="The divergence is averaged over these temperatures."),
    text_weight: float = typer.Option(_dd("text_weight"), "--text-weight", min=0.0,
                                      help="Add this times next-token CE on --text-corpus (no target needed)."),
    text_corpus: str = typer.Option(_dd("text_corpus"), "--text-corpus",
                                    help="'stdlib', a directory of .py files, or a .jsonl file."),
    text_seq_len: int = typer.Option(_dd("text_seq_len"), "--text-seq-len", min=2,
                                     help="Tokens per --text-corpus window."),
    max_context: Optional[int] = typer.Option(None, "--max-context", min=1,
                                              help="Prompt tokens kept before each answer (default: all); "
                                                   "shorter contexts make a step cheaper."),
    threads: Optional[int] = Threads,
    loop: dict = None,
) -> None:
    """Distil a small reduced-vocabulary draft for any target from its chat shards; resumes from --out."""
    from ..models.catalog import resolve_model_name
    from ..training.chat_distill import distill_chat

    setup_training(threads)
    try:
        temps = tuple(float(x) for x in temperatures.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter("expected comma-separated numbers", param_hint="--temperatures") from None
    with user_errors(["model", "logits_dir", "shape", "draft_vocab", "temperatures", "text_corpus", "loss",
                      "max_context"]):
        cfg = ChatDistillConfig(model=resolve_model_name(model), logits_dir=str(logits_dir), out_dir=str(out_dir),
                                shape=shape, draft_vocab=draft_vocab, steps=steps, batch_size=batch_size,
                                alpha=alpha, loss=loss, temperatures=temps, text_weight=text_weight,
                                text_corpus=text_corpus, text_seq_len=text_seq_len, max_context=max_context,
                                **loop)
        with StepProgress(f"distill-chat {shape}") as bar:
            last = distill_chat(cfg, bar)
    report_done(out_dir, last)



def _dr(name: str):
    from ..training.draft_run import DraftRunConfig

    return {f.name: f.default for f in dataclasses.fields(DraftRunConfig)}[name]


def _floats(value: str, option: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {value!r}", param_hint=option) from None


@train_app.command("draft")
def draft_cmd(
    target: str = typer.Option(..., "--target", help="The target: a GGUF file, a checkpoint directory or a fetched "
                                                     "model's name (`leaplm models`)."),
    out_dir: Path = typer.Option(..., "--out", help="Run directory: chatdata/ (shards), draft/ (the draft); rerun "
                                                    "to resume."),
    shape: str = typer.Option(_dr("shape"), help="Draft shape: chat-1x256, chat-2x256 (fresh narrow llamas) or "
                                                 "cut-N (the target's first N layers and its head rows)."),
    draft_vocab: int = typer.Option(_dr("draft_vocab"), "--draft-vocab", min=2,
                                    help="Draft vocabulary rows: the target tokens with most mass, + 1 'other'."),
    prompts: str = typer.Option(_dr("prompts"), "--prompts",
                                help="chat (chat answers through the chat template) or text (a base model's "
                                     "continuations of code and prose)."),
    n_prompts: int = typer.Option(_dr("n_prompts"), "--n-prompts", min=1, help="Answers to generate."),
    new_tokens: int = typer.Option(_dr("new_tokens"), "--new-tokens", min=1, help="Longest answer kept."),
    max_prompt_tokens: int = typer.Option(_dr("max_prompt_tokens"), "--max-prompt-tokens", min=1,
                                          help="Skip chat prompts longer than this (templated)."),
    data_temperatures: str = typer.Option("0,0.8", "--data-temperatures",
                                          help="Comma list; answer shards cycle through them (0 = greedy)."),
    steps: int = typer.Option(_dr("steps"), min=1, help="Distillation steps (raise it and rerun to continue)."),
    batch_size: int = typer.Option(_dr("batch_size"), "--batch-size", min=1, help="Answers per step."),
    lr: float = typer.Option(_dr("lr"), min=0.0),
    loss: str = typer.Option(_dr("loss"), help="kl (forward KL) or tv (total variation: what sampled "
                                               "acceptance pays for)."),
    temperatures: str = typer.Option("1.0,0.8", "--temperatures", help="Distillation: the divergence is averaged "
                                                                       "over these temperatures."),
    sampled_steps: int = typer.Option(_dr("sampled_steps"), "--sampled-steps", min=0,
                                      help="Then this many steps of total variation at --sampled-temperatures "
                                           "(0 = none; raise it and rerun to continue)."),
    sampled_temperatures: str = typer.Option("0.8,1.0", "--sampled-temperatures",
                                             help="The sampled stage's temperatures (comma list)."),
    seed: int = typer.Option(0),
    max_files: Optional[int] = typer.Option(None, min=1, help="Scan only the first N stdlib files (tests)."),
    threads: Optional[int] = Threads,
) -> None:
    """A draft for a target in one command: the target's own chat answers, or a base model's continuations
    (--prompts text), generated by libllama for a GGUF file when installed; then a reduced-vocabulary draft
    distilled on them. Resumable; refuses a directory of another run."""
    from ..models.catalog import resolve_model_name
    from ..training.draft_run import DraftRunConfig, train_draft

    setup_training(threads)
    with user_errors(["target", "out_dir", "shape", "draft_vocab", "loss", "temperatures", "data_temperatures",
                      "sampled_steps", "sampled_temperatures", "prompts"]):
        cfg = DraftRunConfig(target=resolve_model_name(target, "target"), out_dir=str(out_dir), shape=shape,
                             draft_vocab=draft_vocab, prompts=prompts, n_prompts=n_prompts, new_tokens=new_tokens,
                             max_prompt_tokens=max_prompt_tokens,
                             data_temperatures=_floats(data_temperatures, "--data-temperatures"), steps=steps,
                             batch_size=batch_size, lr=lr, loss=loss,
                             temperatures=_floats(temperatures, "--temperatures"), sampled_steps=sampled_steps,
                             sampled_temperatures=_floats(sampled_temperatures, "--sampled-temperatures"),
                             seed=seed, max_files=max_files, threads=threads)
        with counter("chat answers") as prog:
            task = prog.add_task("gen", total=n_prompts)
            state = {"bar": None}

            def on_progress(p) -> None:
                if p.stage == "data":
                    prog.update(task, completed=p.done, total=p.total)
                    return
                if state["bar"] is None:
                    prog.stop()
                    state["bar"] = StepProgress(f"distill {shape}").__enter__()
                state["bar"](p.step_log)

            try:
                last = train_draft(cfg, on_progress)
            finally:
                if state["bar"] is not None:
                    state["bar"].__exit__(None, None, None)
    report_done(out_dir / "draft", last)

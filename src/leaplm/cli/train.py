"""`leaplm train ...`: the training recipes' command line (pretrain, distill, ondata, card; the head and chat
commands register on the same group from cli/heads.py and cli/train_chat.py).

The library reports progress through on_step callbacks; rendering (rich progress bars) happens only here.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..training.distill import DistillConfig
from ..training.ondata import PROMPT_LENGTHS
from ..training.presets import PRESETS
from ..training.loop import StepLog
from ..training.pretrain import PretrainConfig
from .common import StepProgress, counter, err, out, setup_training, user_errors
from .train_options import CORPUS_RUN, LOOP, check_corpus

train_app = typer.Typer(help="Train leaplm's embedded model family: tokenizer, pretraining, distillation.",
                        no_args_is_help=True)


@train_app.callback()
def _train_group() -> None:
    """Train leaplm's embedded model family: tokenizer, pretraining, distillation."""


# ---- shared plumbing ---------------------------------------------------------------------------------------

def _default(cls, name: str):
    """Option defaults come from the config dataclass, so the CLI and the library never disagree."""
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


def acceptance_rows(path: Path | None) -> list[dict] | None:
    """The --acceptance file of a model card: `eval acceptance --json` rows."""
    if path is None:
        return None
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not valid JSON: {e}", param_hint="--acceptance") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise typer.BadParameter("must be a JSON list of objects", param_hint="--acceptance")
    return rows


def check_preset(value: str) -> str:
    if value not in PRESETS:
        raise typer.BadParameter(f"{value!r} unknown; choose from {', '.join(PRESETS)}")
    return value


def check_model_dir(value: Path) -> Path:
    if not (value / "config.json").exists():
        raise typer.BadParameter(f"{str(value)!r} is not a Hugging Face checkpoint directory (no config.json)")
    return value


def check_tokenizer_dir(value: Path) -> Path:
    if not (value / "tokenizer_config.json").exists():
        raise typer.BadParameter(f"{str(value)!r} has no tokenizer (run `leaplm train tokenizer` first)")
    return value


def check_draft_init(value: str) -> str:
    if value not in PRESETS and not (Path(value) / "config.json").exists():
        raise typer.BadParameter(f"{value!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
    return value


# torch's threads, an option of every training command
Threads = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: torch's choice).")


# ---- leaplm train tokenizer --------------------------------------------------------------------------------

@train_app.command("tokenizer")
def tokenizer_cmd(
    out_dir: Path = typer.Option(..., "--out", help="Directory to write the tokenizer to."),
    corpus: str = typer.Option("stdlib", callback=check_corpus,
                               help="'stdlib', a directory of .py files, or a .jsonl file with a 'text' field."),
    vocab_size: int = typer.Option(8192, min=300, help="Vocabulary size (256 bytes + merges + EOS)."),
    max_files: Optional[int] = typer.Option(None, min=1, help="Use only the first N files (tests)."),
    threads: Optional[int] = Threads,
) -> None:
    """Train a byte-level BPE tokenizer on the corpus's training split."""
    from ..training.corpus import corpus_texts
    from ..training.tokenizer import train_tokenizer

    setup_training(threads)
    with user_errors(["corpus", "vocab_size", "max_files"]):
        with err.status("training tokenizer"):
            tok = train_tokenizer(corpus_texts(corpus, "train", max_files), out_dir, vocab_size)
    out.print(f"tokenizer with {len(tok)} tokens written to {out_dir}")


# ---- leaplm train pretrain ---------------------------------------------------------------------------------

@train_app.command("pretrain")
@LOOP.options(PretrainConfig, into="loop")
@CORPUS_RUN.options(PretrainConfig, into="run")
def pretrain_cmd(
    out_dir: Path = typer.Option(..., "--out", help="Run and checkpoint directory (rerun to resume)."),
    tokenizer_dir: Path = typer.Option(..., "--tokenizer", callback=check_tokenizer_dir,
                                       help="Tokenizer directory from `leaplm train tokenizer`."),
    preset: str = typer.Option(_default(PretrainConfig, "preset"), help=f"Architecture: {', '.join(PRESETS)}.",
                               callback=check_preset),
    threads: Optional[int] = Threads,
    run: dict = None,
    loop: dict = None,
) -> None:
    """Pretrain a model (target or draft preset) with next-token cross-entropy; resumes from --out."""
    from ..training.pretrain import pretrain

    setup_training(threads)
    cfg = PretrainConfig(out_dir=str(out_dir), tokenizer_dir=str(tokenizer_dir), preset=preset, **run, **loop)
    with user_errors([f.name for f in dataclasses.fields(cfg)]), StepProgress(f"pretrain {preset}") as bar:
        last = pretrain(cfg, bar)
    report_done(out_dir, last)


# ---- leaplm train distill ----------------------------------------------------------------------------------

@train_app.command("distill")
@LOOP.options(DistillConfig, into="loop")
@CORPUS_RUN.options(DistillConfig, into="run")
def distill_cmd(
    target_dir: Path = typer.Option(..., "--target", callback=check_model_dir,
                                    help="Target checkpoint directory (with its tokenizer)."),
    out_dir: Path = typer.Option(..., "--out", help="Run and checkpoint directory (rerun to resume)."),
    draft_init: str = typer.Option(_default(DistillConfig, "draft_init"), callback=check_draft_init,
                                   help="Draft preset (random init) or checkpoint directory to start from."),
    alpha: float = typer.Option(_default(DistillConfig, "alpha"), min=0.0, max=1.0,
                                help="Loss = alpha * KL(p || q) + (1 - alpha) * CE."),
    logits_dir: Optional[Path] = typer.Option(
        None, "--logits-dir", help="Train on cached target logits (`train ondata --top-k`) instead of running the "
                                   "target: --tokens then counts generated positions; --corpus and --seq-len are unused."),
    loss: str = typer.Option(_default(DistillConfig, "loss"),
                             help="With --logits-dir: divergence between p and q at each --temperatures: kl (forward "
                                  "KL) or tv (total variation, what sampled acceptance pays for)."),
    temperatures: str = typer.Option(",".join(f"{t:g}" for t in _default(DistillConfig, "temperatures")),
                                     "--temperatures", help="With --logits-dir: comma list of T at which p_T and "
                                                            "q_T are compared (loss averaged); 1 = the raw logits."),
    threads: Optional[int] = Threads,
    run: dict = None,
    loop: dict = None,
) -> None:
    """Distil a draft from a target: forward KL on the target's logits (online, or cached by `train ondata
    --top-k`), mixed with CE; resumes from --out."""
    from ..training.distill import distill

    setup_training(threads)
    try:
        temps = tuple(float(x) for x in temperatures.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {temperatures!r}",
                                 param_hint="--temperatures") from None
    cfg = DistillConfig(target_dir=str(target_dir), out_dir=str(out_dir), draft_init=draft_init, alpha=alpha,
                        logits_dir=str(logits_dir) if logits_dir else None, loss=loss, temperatures=temps,
                        **run, **loop)
    with user_errors([f.name for f in dataclasses.fields(cfg)]), StepProgress(f"distill {draft_init}") as bar:
        last = distill(cfg, bar)
    report_done(out_dir, last)


def report_done(out_dir: Path, last: StepLog | None) -> None:
    if last is None:
        out.print(f"nothing to do: {out_dir} already finished its budget (raise --tokens to continue)")
        return
    ev = f", held-out CE {last.eval_loss:.4f}" if last.eval_loss is not None else ""
    out.print(f"done: step {last.step}/{last.steps}, loss {last.loss:.4f}{ev}; checkpoint in {out_dir}")


# ---- leaplm train card -------------------------------------------------------------------------------------

@train_app.command("card")
def card_cmd(
    model_dir: Path = typer.Option(..., "--model", callback=check_model_dir,
                                   help="Model directory written by pretrain or distill."),
    name: Optional[str] = typer.Option(None, help="Card title (default: the directory name)."),
    with_perplexity: bool = typer.Option(True, "--perplexity/--no-perplexity",
                                         help="Measure held-out perplexity (stdlib corpus) for the card."),
    ppl_tokens: int = typer.Option(1 << 18, min=2, help="Tokens scored for the perplexity."),
    acceptance: Optional[Path] = typer.Option(None, exists=True, dir_okay=False,
                                              help="JSON file: a list of row objects for the acceptance table."),
    threads: Optional[int] = Threads,
) -> None:
    """Write README.md (model card) and loss_curve.png into a model directory."""
    from ..training.modelcard import read_train_record, write_model_card
    from ..training.perplexity import perplexity

    setup_training(threads)
    rows = acceptance_rows(acceptance)
    with user_errors(["model_dir"]):
        record = read_train_record(model_dir)
        ppl = None
        if with_perplexity and record.config.get("corpus") == "stdlib":
            ppl = perplexity_with_bar(perplexity, str(model_dir), "stdlib", "heldout",
                                       max_tokens=ppl_tokens, max_files=record.config.get("max_files"))
        path = write_model_card(model_dir, name=name, perplexity=ppl, acceptance=rows)
    out.print(f"model card written to {path}")


def perplexity_with_bar(fn, model_dir: str, corpus: str, split: str, **kw):
    with Progress(TextColumn("[bold]perplexity"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err) as progress:
        task = progress.add_task("perplexity", total=None)
        return fn(model_dir, corpus, split, on_batch=lambda d, n: progress.update(task, completed=d, total=n), **kw)


@train_app.command("ondata")
def ondata_cmd(
    target_dir: Path = typer.Option(..., "--target", callback=check_model_dir, help="Target checkpoint directory."),
    out_path: Path = typer.Option(..., "--out", help="JSONL file to write ({'text': ...} per line); with --top-k, "
                                                     "a directory of logit shards."),
    n_seqs: int = typer.Option(2048, "--n-seqs", min=1, help="Sequences to generate (with --top-k: over all parts)."),
    prompt_tokens: int = typer.Option(64, "--prompt-tokens", min=1,
                                      help="Corpus window used as each prompt (JSONL mode; shards cycle 96/192/320 "
                                           "tokens ending at a def line)."),
    new_tokens: int = typer.Option(128, "--new-tokens", min=1, help="Target tokens generated per prompt."),
    batch_size: int = typer.Option(64, "--batch-size", min=1),
    temperature: float = typer.Option(0.0, min=0.0, max=10.0,
                                      help="0 = greedy continuations (what greedy acceptance sees); > 0 samples "
                                           "them (seeded), visiting the states users who sample see."),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=1, max=256,
                                        help="Also cache the target's top-k log-probs (raw, temperature 1) per "
                                             "generated token, as safetensors shards for `train distill "
                                             "--logits-dir`; any temperature is derived from them."),
    prompt_lengths: str = typer.Option(",".join(map(str, PROMPT_LENGTHS)), "--prompt-lengths",
                                       help="With --top-k: comma list of prompt lengths, cycled over the shards "
                                            "(prefill dominates the cost: shorter prompts generate faster)."),
    part: int = typer.Option(0, "--part", min=0, help="With --top-k: this process's part (run --parts of them)."),
    parts: int = typer.Option(1, "--parts", min=1, help="With --top-k: processes sharing the output directory."),
    seed: int = typer.Option(0),
    threads: Optional[int] = Threads,
) -> None:
    """Generate on-policy distillation data: the target's continuations of training-corpus prompts."""
    from ..training.ondata import generate_target_corpus, generate_target_logits

    setup_training(threads)
    if part >= parts:
        raise typer.BadParameter(f"must be < --parts ({parts}), got {part}", param_hint="--part")
    try:
        lengths = tuple(int(x) for x in prompt_lengths.split(",") if x.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        raise typer.BadParameter(f"expected comma-separated positive integers, got {prompt_lengths!r}",
                                 param_hint="--prompt-lengths")
    with counter("target continuations") as prog:
        task = prog.add_task("gen", total=n_seqs if top_k is None else -(-n_seqs // parts))
        if top_k is None:
            rows = generate_target_corpus(str(target_dir), out_path, n_seqs, prompt_tokens, new_tokens, batch_size,
                                          temperature, seed, on_batch=lambda r: prog.update(task, completed=r))
        else:
            with user_errors(["n_seqs", "top_k", "part", "temperature"]):
                rows = generate_target_logits(str(target_dir), out_path, n_seqs, new_tokens, top_k, batch_size,
                                              seed, prompt_lengths=lengths, part=part, parts=parts,
                                              temperature=temperature,
                                              on_batch=lambda r: prog.update(task, completed=r))
    out.print(f"wrote {rows} sequences to {out_path}")

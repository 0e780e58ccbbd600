"""`leaplm eval ...`: held-out perplexity and speculative acceptance of trained models."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .common import err, out, setup_training, user_errors
from .train import Threads, check_corpus, check_model_dir, perplexity_with_bar

eval_app = typer.Typer(help="Evaluate models: held-out perplexity, speculative acceptance.", no_args_is_help=True)


@eval_app.callback()
def _eval_group() -> None:
    """Evaluate models."""


# ---- leaplm eval perplexity --------------------------------------------------------------------------------

@eval_app.command("perplexity")
def perplexity_cmd(
    model_dir: Path = typer.Option(..., "--model", callback=check_model_dir, help="Checkpoint directory."),
    corpus: str = typer.Option("stdlib", callback=check_corpus,
                               help="'stdlib', a directory of .py files, or a .jsonl file (scored whole)."),
    split: str = typer.Option("heldout", help="stdlib split: heldout or train."),
    seq_len: int = typer.Option(512, min=2, help="Window length; each window's first token is not scored."),
    batch_size: int = typer.Option(8, min=1, help="Windows per forward."),
    max_tokens: int = typer.Option(1 << 18, min=2, help="Score at most this many tokens, spread over the split."),
    max_files: Optional[int] = typer.Option(None, min=1, help="Use only the first N files (tests)."),
    bf16: bool = typer.Option(True, help="bf16 autocast."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    threads: Optional[int] = Threads,
) -> None:
    """Held-out perplexity of a model on a corpus split (the stdlib's held-out modules by default)."""
    from ..training.perplexity import perplexity

    if split not in ("heldout", "train"):
        raise typer.BadParameter(f"must be 'heldout' or 'train', got {split!r}", param_hint="--split")
    setup_training(threads)
    with user_errors(["corpus", "split", "seq_len", "max_files"]):
        r = perplexity_with_bar(perplexity, str(model_dir), corpus, split, seq_len=seq_len,
                                 batch_size=batch_size, max_tokens=max_tokens, max_files=max_files, bf16=bf16)
    if as_json:
        out.print_json(data=dataclasses.asdict(r) | {"perplexity": r.perplexity})
        return
    t = Table("model", "corpus/split", "tokens", "CE (nats)", "perplexity")
    t.add_row(r.model_dir, f"{r.corpus}/{r.split}", f"{r.tokens:,}", f"{r.loss:.4f}", f"{r.perplexity:.3f}")
    out.print(t)


# ---- leaplm eval acceptance --------------------------------------------------------------------------------
@eval_app.command("acceptance")
def acceptance_cmd(
    target: Optional[str] = typer.Option(None, "--target", help="Target checkpoint (default: the embedded target)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Draft checkpoint (default: the embedded draft)."),
    method: str = typer.Option("draft", "--method", help="draft | eagle | medusa (heads: K is the tree's node "
                                                         "budget)."),
    head: Optional[str] = typer.Option(None, "--head", help="eagle/medusa: head directory (default: the head "
                                                            "shipped for the target)."),
    ks: str = typer.Option("1,2,3,4,5,6,7,8", "--k", help="Comma list of K."),
    temperatures: str = typer.Option("0,0.8", "--temperatures", help="Comma list of temperatures (0 = greedy)."),
    prompts: int = typer.Option(8, min=1, help="Held-out prompts of --workload (never trained on)."),
    workload: str = typer.Option("code", "--workload", help="Benchmark workload: code, copy, chat-code, chat-edit, "
                                                            "chat-question (chat ones through the target's template)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    seed: int = typer.Option(0),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the rows here (input of `train card`)."),
    threads: Optional[int] = Threads,
) -> None:
    """Acceptance rate and mean accepted length of a draft against its target, per K and temperature."""
    from ..bench.workloads import as_chat, fit_to_context, get_workload
    from ..models import embedded, load_model
    from ..training.acceptance import eval_acceptance

    setup_training(threads)
    try:
        k_list = [int(x) for x in ks.split(",") if x.strip()]
        temps = [float(x) for x in temperatures.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter("expected comma-separated numbers", param_hint="--k/--temperatures") from None
    if not k_list or min(k_list) < 1:
        raise typer.BadParameter("each K must be >= 1", param_hint="--k")
    if not temps or min(temps) < 0:
        raise typer.BadParameter("temperatures must be >= 0", param_hint="--temperatures")
    if method not in ("draft", "eagle", "medusa"):
        raise typer.BadParameter(f"must be draft, eagle or medusa, got {method!r}", param_hint="--method")
    with user_errors(["model", "draft", "workload", "head"]):
        tgt = load_model(target or embedded.default_target(), field="model")
        # no --draft: the embedded default draft, or the one shipped for this target (matched by tokenizer)
        drf = None if method != "draft" else load_model(
            draft or (embedded.draft_for(tgt.tokenizer) if target else embedded.default_draft()) or "", field="draft")
        w = as_chat(get_workload(workload, prompts), tgt.tokenizer, tgt.name)
    w = fit_to_context(w, tgt.tokenizer, min(tgt.model.max_len, 4096) - max_new_tokens - max(k_list) - 2)
    name = drf.name if drf is not None else f"{method} head {head or '(shipped)'}"
    t = Table("temperature", "K", "acceptance rate", "mean accepted length", "drafted", title=f"{name} -> {tgt.name}")
    with user_errors(["head"]):
        rows = eval_acceptance(tgt, drf, w.prompts, k_list, temps, max_new_tokens, seed,
                               on_row=lambda r: err.print(f"[dim]T={r.temperature} K={r.k}: "
                                                          f"acceptance {r.acceptance_rate:.3f}[/]"),
                               method=method, head=head)
    for r in rows:
        t.add_row(f"{r.temperature:g}", str(r.k), f"{r.acceptance_rate:.3f}", f"{r.mean_accepted_length:.2f}",
                  str(r.draft_tokens))
    out.print(t)
    if json_out:
        json_out.write_text(json.dumps([{"temperature": r.temperature, "K": r.k,
                                         "acceptance rate": round(r.acceptance_rate, 3),
                                         "mean accepted length": round(r.mean_accepted_length, 2),
                                         "drafted": r.draft_tokens, "prompts": r.prompts} for r in rows], indent=1))

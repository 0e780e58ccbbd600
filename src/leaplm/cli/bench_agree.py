"""`leaplm bench agree`: leaplm's greedy tokens on a GGUF file against libllama's, with each disagreement's logit gaps
(bench/agreement.py)."""
from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from .common import fail, out, set_threads


def bench_agree(
    model: str = typer.Option(..., "--model", help="A GGUF file (or a catalog name that resolves to one)."),
    backend: str = typer.Option("auto", "--backend", help="leaplm's side: auto (the default backend) or torch."),
    workloads: str = typer.Option("code,copy", "--workloads", help="Comma list of completion workloads "
                                  "(bench/workloads.py) whose prompts are compared."),
    prompts: int = typer.Option(10, "--prompts", help="Prompts per workload."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Greedy tokens compared per prompt."),
    near_tie: float = typer.Option(3.0, "--near-tie", help="A disagreement whose two logit gaps add up to at most "
                                   "this many standard deviations of the backends' rounding differences (measured "
                                   "at that position) counts as a near-tie."),
    threads: int = typer.Option(2, "--threads"),
    json_path: str = typer.Option("bench-agree.json", "--json", help="Report path."),
) -> None:
    """Greedy tokens of both backends per prompt; where they part, each backend's gap between the two choices."""
    from ..bench.agreement import agreement, engine_backend
    from ..bench.workloads import get_workload
    from ..config import ConfigError
    from ..models import load_model

    for name, v in (("prompts", prompts), ("max-new-tokens", max_new_tokens), ("threads", threads)):
        if v < 1:
            fail(f"--{name}: must be >= 1, got {v}")
    if not 0 < near_tie <= 100:
        fail(f"--near-tie: must be in (0, 100], got {near_tie}")
    if backend not in ("auto", "torch"):
        fail(f"--backend: leaplm's side is auto or torch (libllama is the other side), got {backend!r}")
    set_threads(threads)
    try:
        ours = load_model(model, backend=backend, quantization="gguf")
        theirs = load_model(model, backend="llamacpp")
        texts = [p for w in workloads.split(",") if w.strip() for p in get_workload(w.strip(), prompts).prompts]
    except ConfigError as e:
        fail(f"--{e.field}: {e.message}")
    if ours.backend == "llamacpp":
        fail("--backend: the default backend for this file is libllama itself; pass --backend torch")
    a, b = engine_backend(ours), engine_backend(theirs)
    enc = [(t, a.encode(t)) for t in texts]                       # the same ids to both
    rep = agreement(ours.path, enc, max_new_tokens, a.decode, b.decode, a.score, b.score, near_tie)
    t = Table(title=f"greedy agreement with libllama over {max_new_tokens} tokens")
    for c in ("prompt", "agreed", "leaplm gap", "libllama gap", "rounding sd", "z", "near-tie"):
        t.add_column(c)
    for p in rep.prompts:
        d = p.divergence
        t.add_row(repr(p.prompt[-40:]), f"{p.agreed}/{p.tokens}", "-" if d is None else f"{d.our_gap:.3f}",
                  "-" if d is None else f"{d.their_gap:.3f}", "-" if d is None else f"{d.noise:.3f}",
                  "-" if d is None else f"{d.z:.2f}", "-" if d is None else ("yes" if d.z <= near_tie else "NO"))
    out.print(t)
    out.print(f"identical over {max_new_tokens} tokens: {rep.identical_share:.0%} of {len(rep.prompts)} prompts; "
              f"disagreements not near-ties: {len(rep.unexplained)}; report: {json_path}")
    Path(json_path).write_text(json.dumps(rep.to_dict(), indent=1))

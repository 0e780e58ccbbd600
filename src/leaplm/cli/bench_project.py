"""`leaplm bench project`: projected speedups of speculation on other model sizes, from measured block-cost curves
and acceptance traces (bench/projection.py); --check compares the projection with one run's own measurements."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from .common import fail, out


def bench_project(
    curve: List[str] = typer.Option(..., "--curve", help="A `leaplm bench --roofline` JSON of the target (one "
                                    "per shape; repeat the option)."),
    traces: List[str] = typer.Option(..., "--traces", help="A roofline or `leaplm bench` JSON whose speculative "
                                     "rows give the acceptance (repeat the option)."),
    which: str = typer.Option("forwards", "--curve-name", help="forwards (whole forwards) or a block-cost "
                              "curve's kernel, or kernel/weight type, in the roofline JSON."),
    propose_ms: Optional[List[str]] = typer.Option(None, "--propose-ms", help="METHOD=MS: a proposer's cost per "
                                                   "generated token, overriding the traces' (e.g. draft=2.5)."),
    check: bool = typer.Option(False, "--check", help="Compare the projection with the speedups the traces "
                               "measured (the curve and traces of one run)."),
    tolerance: float = typer.Option(0.10, "--tolerance", help="--check: the largest |projected / measured - 1| "
                                    "that passes."),
    out_path: str = typer.Option("bench-project.json", "--out", help="JSON report path."),
) -> None:
    """Project tokens per step over the block cost at K + 1 into a speedup per (shape, method, workload)."""
    from ..bench.projection import load_curve, load_traces, project
    from ..config import ConfigError

    overrides = {}
    for item in propose_ms or []:
        name, _, ms = item.partition("=")
        try:
            overrides[name.strip()] = float(ms)
        except ValueError:
            fail(f"--propose-ms: {item!r} is not METHOD=MS")
    try:
        curves = [load_curve(c, which) for c in curve]
        ts = [t for p in traces for t in load_traces(p)]
        if not ts:
            fail("--traces: no speculative configuration in " + ", ".join(traces))
        rep = project(curves, ts, overrides, tolerance if check else None)
    except ConfigError as e:
        fail(f"--{e.field}: {e.message}")
    t = Table(title="projected speedup = tau (c1 + o) / (c1 (f r(K+1) + 1 - f) + p tau + o)")
    cols = ["shape", "method", "workload", "tau", "K+1", "f", "step cost", "p ms", "projected"]
    cols += ["measured", "error", "step cost in decoding"] if check else []
    for col in cols:
        t.add_column(col)
    for r in rep.rows:
        row = [Path(r.shape).name, r.method, r.workload, f"{r.tau:.3f}", f"{r.block:g}", f"{r.drafting:.2f}",
               f"{r.cost_ratio:.3f}",
               f"{r.propose_ms:.3f}", f"{r.speedup:.3f}"]
        if check:
            row += ["-" if r.measured_speedup is None else f"{r.measured_speedup:.3f}",
                    "-" if r.error is None else f"{r.error:+.1%}",
                    "-" if r.decode_ratio is None else f"{r.decode_ratio:.3f}"]
        t.add_row(*row)
    out.print(t)
    Path(out_path).write_text(json.dumps(rep.to_dict(), indent=1))
    if check:
        out.print(f"largest |error| {rep.max_error:.1%} (tolerance {tolerance:.0%}): "
                  f"{'within' if rep.passed else 'OUTSIDE'} the tolerance; report: {out_path}")
        if not rep.passed:
            raise typer.Exit(1)
    else:
        out.print(f"report: {out_path}")

"""`leaplm tune`: measure, then decide whether and how to speculate (see tune/__init__.py); the result's
tables."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import typer
from rich.progress import Progress
from rich.table import Table

from ..config import ConfigError
from ..tune.result import ALL_METHODS, build_result
from .common import EngineOptions, engine_options, err, fail, set_threads
from .common import wide as console


def _int_list(text: str, option: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"{option}: expected comma-separated integers, got {text!r}")
    if not out:
        fail(f"{option}: give at least one value")
    return out


@engine_options(without=("quantization", "kv_cache_dtype"))
def tune(
    draft: Optional[list[str]] = typer.Option(None, "--draft", help="Draft model to try (repeatable; default: "
                                                                    "every shipped draft that fits the target)."),
    methods: str = typer.Option(",".join(ALL_METHODS), help="Comma list of methods to try."),
    workload: str = typer.Option("code", help="code | copy | chat | noise | FILE (blank-line separated "
                                              "prompts, or .jsonl with a 'prompt' per line)."),
    concurrency: str = typer.Option("1,4", help="Comma list of client concurrency levels (e.g. 1,4,16)."),
    budget_s: float = typer.Option(300.0, "--budget-s", help="Wall-clock budget, loading included."),
    prompts: int = typer.Option(4, help="Prompts taken from the workload."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens"),
    k_grid: Optional[str] = typer.Option(None, "--k-grid", help="Ks tried for every method (default: per method)."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 measures sampling (acceptance differs)."),
    seed: int = typer.Option(0),
    min_gain: float = typer.Option(0.05, "--min-gain", help="Speculate only above (1 + this) x the baseline."),
    max_rounds: int = typer.Option(5, "--max-rounds", help="Most timed rounds (fewer when the budget ends)."),
    adaptive_k: bool = typer.Option(True, "--adaptive-k/--fixed-k", help="Measure as served: K is a cap that "
                                                                        "measured costs may lower."),
    draft_device: Optional[str] = typer.Option(None, "--draft-device", help="Device of the draft (default: the "
                                                                           "target's)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Directory for speedup-vs-K and acceptance plots."),
    *, options: EngineOptions,
):
    """Measure the baseline and every method/draft over a K grid, then recommend a configuration per
    concurrency level (or 'off'), with the flags to serve it."""
    started = time.perf_counter()
    from ..devices import check_device
    from ..models import embedded, load_model
    from ..models.loading import draft_backend
    from ..tune.candidates import build_candidates
    from ..tune.measure import BudgetTooSmall, Measurer, TuneSettings, check_levels
    from ..tune.workloads import tune_workload

    logging.basicConfig(level=logging.WARNING)
    levels = _int_list(concurrency, "--concurrency")
    grid = _int_list(k_grid, "--k-grid") if k_grid else None
    for name, v, lo in (("prompts", prompts, 1), ("max-new-tokens", max_new_tokens, 2), ("max-rounds", max_rounds, 1)):
        if v < lo:
            fail(f"--{name}: must be >= {lo}, got {v}")
    if not (budget_s > 0 and budget_s < 1e7):
        fail(f"--budget-s: must be a positive number of seconds below 1e7, got {budget_s}")
    if not (0 <= min_gain < 10):
        fail(f"--min-gain: must be in [0, 10), got {min_gain}")
    if not (0 <= temperature <= 100):
        fail(f"--temperature: must be in [0, 100], got {temperature}")
    if grid and any(k < 1 or k > 8 for k in grid):
        fail(f"--k-grid: Ks must be in [1, 8], got {grid}")
    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    bad = [m for m in wanted if m not in ALL_METHODS]
    if bad or not wanted:
        fail(f"--methods: unknown {bad or methods!r}; choose from {', '.join(ALL_METHODS)}")
    set_threads(options.threads)
    try:
        check_levels(levels)
        check_device(options.device, "device")
        check_device(draft_device or options.device, "draft_device")
        w = tune_workload(workload, prompts)
        target = load_model(options.model or embedded.default_target(), options.device, options.dtype, "model",
                            backend=options.backend)
        drafts: dict = {}
        draft_paths: dict[str, str] = {}
        if "draft" in wanted:
            names = draft or [str(embedded.embedded_path(n)) for n in embedded.DRAFTS
                              if (embedded.embedded_path(n) / "config.json").exists()]
            for n in names:
                label = Path(n).name or n
                try:
                    drafts[label] = load_model(n, draft_device or options.device, options.dtype, "draft",
                                               backend=draft_backend(options.backend))
                    draft_paths[label] = n
                except ConfigError as e:
                    if draft:            # the user named it: a path that does not load is an error
                        raise
                    drafts[label] = e.message
        from ..models.loading import resolve_max_model_len

        context = resolve_max_model_len(options.max_model_len, target.model.max_len, target.name)
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}")
    from ..bench.workloads import fit_to_context

    room = context - max_new_tokens - 12
    if room < 8:
        fail(f"--max-new-tokens: {max_new_tokens} leaves no room for a prompt in the context of {context}")
    w = fit_to_context(w, target.tokenizer, min(room, 384))
    longest = max(len(target.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in w.prompts)
    max_len = min(context, longest + max_new_tokens + 12)
    cset = build_candidates(target, drafts, wanted, grid)
    loaded_drafts = {k: v for k, v in drafts.items() if not isinstance(v, str)}
    settings = TuneSettings(levels=levels, prompts=len(w.prompts), max_new_tokens=max_new_tokens,
                            temperature=temperature, seed=seed, adaptive_k=adaptive_k, budget_s=budget_s,
                            max_rounds=max_rounds, dtype=options.dtype, device=options.device,
                            draft_device=draft_device)
    meas = Measurer(target, loaded_drafts, w.prompts, settings, max_len)
    for line in cset.skipped:
        err.print(f"[yellow]skipped[/] {line}")
    try:
        with Progress(console=err, transient=True) as prog:
            task = prog.add_task("timing the baseline", total=None)
            try:
                plan = meas.plan(cset.baseline, started)
            except BudgetTooSmall as e:
                fail(f"--budget-s: {budget_s:g} s is too short: {e.detail}; the minimum for this model, workload "
                      f"and --concurrency is about {e.minimum_s:.0f} s")
            prog.update(task, description="measuring", total=None, completed=0)

            def on_sample(s, c, level):
                prog.update(task, advance=1, description=f"round {s.round + 1}: {c.label} at concurrency {level}")

            samples, positions = meas.measure(plan, cset.ordered, cset.baseline, started, on_sample)
    finally:
        meas.close()
    result = build_result(target, options.model, loaded_drafts, draft_paths, cset, plan, samples, positions,
                          settings, min_gain, w, max_len, started)
    if as_json:
        print(json.dumps(result, default=str))
    else:
        print_result(result)
    if plot:
        from ..tune.plots import plot_tune

        plot.mkdir(parents=True, exist_ok=True)
        for p in plot_tune(result, plot):
            err.print(f"[dim]wrote {p}[/]")


def print_result(res: dict) -> None:
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    s = res["settings"]
    t = Table(title=f"leaplm tune: {res['model']}, workload {res['workload']}, {s['max_new_tokens']} new tokens, "
                    f"temperature {s['temperature']}, {res['rounds']} rounds (medians; speedup paired vs none)")
    for col in ("conc.", "config", "checklist step", "tokens/s", "speedup", "acceptance (4)", "mean acc. len",
                "= none", "memory added"):
        t.add_column(col, justify="left" if col in ("config", "checklist step") else "right")
    for r in res["rows"]:
        t.add_row(str(r["concurrency"]), r["config"], r["step"], f(r["tokens_per_s"], 1),
                  f(r["speedup"]) + ("x" if r["speedup"] is not None else ""), f(r["acceptance_rate"]),
                  f(r["mean_accepted_length"]), "-" if r["identical"] is None else ("yes" if r["identical"] else "NO"),
                  f"{r['memory_added_mb']:.1f} MB" if r["memory_added_mb"] else "0")
    console.print(t)
    d = res["decision"]
    t2 = Table(title="recommendation per concurrency level")
    for col in ("conc.", "speculate", "configuration", "speedup", "acceptance", "baseline tok/s", "why"):
        t2.add_column(col)
    for lv in d["levels"]:
        t2.add_row(str(lv["level"]), "on" if lv["speculate"] else "OFF", lv["choice"], f(lv["speedup"]) + "x"
                   if lv["speedup"] else "-", f(lv["acceptance_rate"]), f(lv["baseline_tokens_per_s"], 1), lv["reason"])
    console.print(t2)
    console.print(f"[bold]speculation:[/] {'on' if d['speculate'] else 'off (nothing measured pays on this workload)'}")
    console.print(f"  serve:   {d['serve']}\n  python:  {d['python']}\n  vLLM:    {d['vllm_style']}")
    for n in d["notes"]:
        console.print(f"  note: {n}")
    if res["dropped_after_screening"]:
        console.print(f"  screened out after round 1 (K not tuned): {', '.join(res['dropped_after_screening'])}")
    if res["unmeasured"]:
        console.print(f"  not measured (budget): {', '.join(res['unmeasured'])}; a larger --budget-s measures them")
    for line in res["skipped"]:
        console.print(f"  skipped: {line}")
    console.print(f"[dim]{res['elapsed_s']} s (loading and baseline {res['setup_s']} s); machine: "
                  f"{res['machine']['cpu']}, {res['machine']['cores']} cores, torch threads "
                  f"{res['machine']['torch_threads']}[/]")

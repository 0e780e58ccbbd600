"""`leaplm bench`: methods side by side (and Hugging Face's generate with --baselines hf, llama.cpp's binaries
with --baselines llamacpp, the roofline with --roofline); `leaplm bench memory` (peak RSS); `leaplm bench report`
(the result files as markdown tables). `leaplm bench serve`
lives in cli/bench_serve.py."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer
from rich.progress import Progress
from rich.table import Table

from ..config import METHODS, ConfigError, SamplingParams
from .common import EngineOptions, engine_options, err, fail, set_threads
from .common import wide as console

bench_app = typer.Typer(add_completion=False, invoke_without_command=True,
                        help="Benchmark methods side by side; `leaplm bench serve` for the server load test.")


SCHEMA = "+schema"          # a method run with each prompt's constraint (structured workloads)
PREDICTION = "+prediction"  # a method run with each prompt's prediction (edit, proofread, quote, agent, complete)


def parse_methods(text: str, k: int) -> list[tuple[str, str, dict]]:
    """'none,draft,ngram:k=8,suffix+schema' -> [(label, method, options)]; options are SpecConfig fields, and
    `structured: True` for a method written with +schema (run with each prompt's constraint)."""
    out = []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        method, _, rest = item.partition(":")
        opts: dict = {"k": k}
        if method.endswith(PREDICTION):
            method, opts["predicted"] = method[: -len(PREDICTION)], True
        if method.endswith(SCHEMA):
            method, opts["structured"] = method[: -len(SCHEMA)], True
        for kv in [x for x in rest.split(";") if x]:
            key, _, val = kv.partition("=")
            if key in ("adaptive_k", "forced_tokens"):
                opts[key] = val.lower() in ("1", "true", "yes")
            elif key == "skip_layers":
                opts[key] = [int(v) for v in val.split("/") if v]
            elif key in ("draft", "corpus", "head", "verifier"):
                opts[key] = val
            else:
                try:
                    opts[key] = int(val)
                except ValueError:
                    fail(f"--methods: option {key!r} of {method!r} needs an integer, got {val!r}")
        extra = ";".join(x for x in rest.split(";") if x and not x.startswith("k="))
        # the first plain decoding is the baseline every speedup pairs with, labelled "none" whatever options it
        # names (`none:verifier=rejection` beside methods that name it too; settings.methods keeps them)
        baseline = (method == "none" and not opts.get("structured") and not opts.get("predicted")
                    and not any(m == "none" and not o.get("predicted") for _, m, o in out))
        label = method if method == "none" else f"{method} k={opts['k']}"
        label += (" " + SCHEMA if opts.get("structured") else "") + (" " + PREDICTION if opts.get("predicted") else "")
        label += f" {extra}" if extra and not baseline else ""
        out.append((label, method, opts))
    if not out or out[0][1] != "none" or out[0][2].get("predicted") or out[0][2].get("structured"):
        out.insert(0, ("none", "none", {"k": k}))
    return out


@bench_app.callback()
@engine_options(without=("device", "kv_cache_dtype"))
def bench(
    ctx: typer.Context,
    draft: Optional[str] = typer.Option(None, "--draft", help="Draft for method draft (default: embedded)."),
    methods: str = typer.Option("none,draft", help="Comma list; options after ':' separated by ';', e.g. "
                                                   "'none,draft,draft:k=8;adaptive_k=0,ngram:ngram_max=3'."),
    k: int = typer.Option(4, "--k", "-k"),
    workloads: str = typer.Option("code,copy", help="Comma list of: code, copy, chat-code, chat-edit, chat-question, "
                                                    "json-extract, tool-call (structured: a method written "
                                                    "name+schema runs with each prompt's JSON Schema), edit, "
                                                    "proofread, quote, agent, complete (a method written "
                                                    "name+prediction runs with each prompt's prediction)."),
    prompts: int = typer.Option(6, help="Prompts per workload."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens"),
    rounds: int = typer.Option(2, help="Timed rounds over all prompts (after one warm-up)."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples (seeded by --seed; HF baselines too)."),
    seed: int = typer.Option(0),
    baselines: Optional[str] = typer.Option(None, help="Comma list: 'hf' adds transformers generate (plain, "
                                                       "assisted, prompt lookup); 'llamacpp' adds llama.cpp's "
                                                       "binaries (plain, llama-lookup, speculative with the draft "
                                                       "as GGUF, llama-bench tg128) on the same GGUF file."),
    llamacpp_dir: Optional[str] = typer.Option(None, "--llamacpp-dir", help="Directory of llama.cpp's binaries "
                                               "(or its bin/); default $LEAPLM_LLAMACPP_DIR, then PATH."),
    llamacpp_model: Optional[str] = typer.Option(None, "--llamacpp-model", help="GGUF file llama.cpp runs "
                                                 "(default: the target when it is a GGUF file, else the target "
                                                 "written as GGUF: f32, or q8_0 with --quantization int8)."),
    llamacpp_draft: Optional[str] = typer.Option(None, "--llamacpp-draft", help="GGUF draft for llama.cpp's "
                                                 "speculative row (default: the draft written as q8_0 GGUF)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write all figures and samples here."),
    plot: Optional[Path] = typer.Option(None, help="Write a speedup bar chart (PNG) here (with --roofline: the "
                                        "block-cost curves, each method's mean accepted length at K + 1 tokens)."),
    roofline: bool = typer.Option(False, "--roofline", help="Bytes read per forward, measured streaming bandwidth, "
                                  "the floor in ms per token, forward cost for 1..16 tokens, and each method's "
                                  "time per token (propose / score / rest) against the floor."),
    k_sweep: Optional[int] = typer.Option(None, "--k-sweep", help="For each method: adaptive K (at most this K) "
                                          "and every fixed K from 1 to this, with a table of adaptive vs the best "
                                          "fixed K."),
    *, options: EngineOptions,
):
    """Decode tokens/s, speedup over `none`, acceptance and mean accepted length, per workload."""
    if ctx.invoked_subcommand is not None:
        return
    import torch

    from ..engine.engine import Engine, draft_quantization
    from ..models import embedded, load_model
    from ..models.loading import draft_backend
    from ..bench.runner import hf_contenders, leaplm_contender, machine_info, run_bench, summarize
    from ..bench.structured import any_workload
    from ..bench.workloads import as_chat, fit_to_context

    logging.basicConfig(level=logging.WARNING)
    set_threads(options.threads)
    if k_sweep is not None and not 1 <= k_sweep <= 16:
        fail(f"--k-sweep: must be in [1, 16], got {k_sweep}")
    for name, v in (("prompts", prompts), ("rounds", rounds), ("max-new-tokens", max_new_tokens)):
        if v < 1:
            fail(f"--{name}: must be >= 1, got {v}")
    if roofline:
        from .bench_roofline import run_roofline

        configs = parse_methods(methods, k)
        if any(opts.get("structured") for _, _, opts in configs):
            fail(f"--methods: {SCHEMA} configurations run in the benchmark, not in --roofline")
        llama_bins = None
        for b in (x.strip() for x in (baselines or "").split(",") if x.strip()):
            if b != "llamacpp":
                fail(f"--baselines: --roofline compares with 'llamacpp' (llama-bench's one-token forward) only, "
                     f"got {b!r}")
            from ..bench.llamacpp import BENCH, find_binaries

            try:
                llama_bins = find_binaries(llamacpp_dir, need=(BENCH,))
            except ConfigError as e:
                fail(f"--{e.field.replace('_', '-')}: {e.message}")
        return run_roofline(model=options.model, draft=draft, configs=configs, k=k,
                            workloads=workloads, prompts=prompts, max_new_tokens=max_new_tokens, rounds=rounds,
                            dtype=options.dtype, quantization=options.quantization,
                            json_out=json_out, fail=fail, backend=options.backend, plot=plot,
                            llamacpp=llama_bins, llamacpp_model=llamacpp_model)
    kinds_of_baseline = [b.strip() for b in (baselines or "").split(",") if b.strip()]
    for b in kinds_of_baseline:
        if b not in ("hf", "llamacpp"):
            fail(f"--baselines: 'hf' and/or 'llamacpp', got {b!r}")
    llamacpp_bins = None
    if "llamacpp" in kinds_of_baseline:
        from ..bench.llamacpp import find_binaries

        try:
            llamacpp_bins = find_binaries(llamacpp_dir)
        except ConfigError as e:
            fail(f"--{e.field.replace('_', '-')}: {e.message}")
        if temperature > 0:
            fail("--temperature: the llamacpp baseline is greedy only (its identity check needs greedy output)")
    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, ignore_eos=True)
        wls = [any_workload(w.strip(), prompts) for w in workloads.split(",") if w.strip()]
        target_name = options.model or embedded.default_target()
        # the backend the engine would choose for the first speculating method: under --backend auto a method that
        # verifies blocks stays off libllama where llama.cpp's kernels are not batch-invariant for the file
        from ..models.loading import choose_target_backend

        first = next((m for _, m, _ in parse_methods(methods, k) if m != "none"), "none")
        choice = choose_target_backend(target_name, first if first in METHODS else "none", options.backend,
                                       dtype=options.dtype, quantization=options.quantization)
        target = load_model(target_name, dtype=options.dtype, field="model",
                            quantization=choice.quantization or options.quantization, backend=choice.backend)
        if (options.backend == "auto" and target.backend == "llamacpp" and first != "none"
                and not target.model.batch_invariant):
            target = load_model(target_name, dtype=options.dtype, field="model", quantization=options.quantization,
                                backend="torch")
        from ..models.loading import resolve_max_model_len

        context = resolve_max_model_len(options.max_model_len, target.model.max_len, target_name)
        room = context - max_new_tokens - max(k, 8) - 2
        if room < 8:
            fail(f"--max-new-tokens: {max_new_tokens} leaves no room for a prompt in the context of {context}")
        wls = [fit_to_context(as_chat(w, target.tokenizer, target_name), target.tokenizer, room) for w in wls]
        configs = parse_methods(methods, k)
        if k_sweep is not None:
            configs = sweep_configs(configs, k_sweep)
        # no --draft: the embedded default, or the shipped draft trained for this target (matched by tokenizer)
        draft_name = draft or (embedded.default_draft() if options.model is None
                               else embedded.draft_for(target.tokenizer))
        drafts: dict[str, object] = {}
        contenders = []
        for label, method, opts in configs:
            constrained = opts.pop("structured", False)
            predicted = opts.pop("predicted", False)
            if constrained and not all(w.constraints for w in wls):
                fail(f"--methods: {label} needs workloads with constraints (json-extract, tool-call)")
            if predicted and not all(w.predictions for w in wls):
                fail(f"--methods: {label} needs workloads with predictions (edit, proofread, quote, agent, "
                     f"complete)")
            d = None
            if method == "draft":
                dn = opts.pop("draft", None) or draft_name
                if dn is None:
                    fail("--draft: method draft needs a draft model")
                if dn not in drafts:
                    drafts[dn] = load_model(dn, dtype=options.dtype, field="draft",
                                            quantization=draft_quantization(options.quantization, dn),
                                            backend=draft_backend(options.backend))
                d = drafts[dn]
            eng = Engine(target, draft=d, method=method, max_model_len=context, **opts)
            contenders.append(leaplm_contender(label, eng, params, constrained, predicted))
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}")
    import tempfile

    tmp = tempfile.TemporaryDirectory(prefix="leaplm-bench-")
    llama_setup = None
    if llamacpp_bins is not None:
        from .bench_llamacpp import llamacpp_setup

        # llama.cpp's speculative row runs when leaplm's draft method does (same draft, as GGUF)
        with_draft = draft_name if any(m == "draft" for _, m, _ in configs) else None
        dpath = (drafts[with_draft].path if with_draft in drafts else None) if with_draft else None
        llama_setup = llamacpp_setup(llamacpp_bins, target, options.quantization, dpath, llamacpp_model,
                                     llamacpp_draft, torch.get_num_threads(), context, tmp.name, wls, fail)
        from ..bench.llamacpp import llamacpp_contenders

        contenders += llamacpp_contenders(llama_setup, k, tmp.name)
    if "hf" in kinds_of_baseline:
        kinds = ["plain", "lookup"] + (["assisted"] if draft_name else [])
        contenders += hf_contenders(target.path, draft_name and (drafts.get(draft_name) or load_model(draft_name)).path,
                                    k, kinds, ignore_eos=True, dtype=getattr(torch, options.dtype),
                                    temperature=temperature,
                                    seed=seed)
    total = rounds * sum(len(w.prompts) for w in wls) * len(contenders)
    with Progress(console=err, transient=True) as prog:
        task = prog.add_task("benchmarking", total=total)
        try:
            samples = run_bench(contenders, wls, max_new_tokens, rounds, baseline="none",
                                on_sample=lambda s: prog.advance(task))
        except RuntimeError as e:           # a llama.cpp process failed or printed what we cannot read
            from ..bench.llamacpp import LlamaCppOutputError

            if not isinstance(e, LlamaCppOutputError):
                raise
            fail(f"--baselines llamacpp: {e}")
    constrained_none = [c.name for c in contenders if c.constrained and c.name.startswith("none")]
    # constrained configurations against constrained plain decoding: its forced_tokens=0 row when there is one
    base = next((c for c in constrained_none if "forced_tokens=0" in c), constrained_none[0] if constrained_none
                else None)
    summaries = summarize(samples, "none", frozenset(target.eos_token_ids), constrained_baseline=base)
    reference = None
    if llama_setup is not None:
        from .bench_llamacpp import finish_llamacpp

        reference = finish_llamacpp(llama_setup, summaries, samples, target, wls, err)
    tmp.cleanup()
    if temperature > 0:      # sampled outputs match `none` in distribution, not token by token: no identity check
        for s in summaries:
            s.identical = None
    settings = dict(model=target_name, draft=draft_name, methods=methods, k=k, workloads=workloads,
                    prompts=prompts, max_new_tokens=max_new_tokens, rounds=rounds, temperature=temperature,
                    dtype=options.dtype, quantization=options.quantization, baselines=baselines,
                    timing="end to end incl. prefill; speedup = median of per-(round, prompt) ratios vs none",
                    backend=target.backend, draft_backends={n: d.backend for n, d in drafts.items()},
                    exactness=leaplm_exactness(target))
    if llama_setup is not None:
        settings["llamacpp"] = dict(model=llama_setup.model, draft=llama_setup.draft, threads=llama_setup.threads,
                                    no_repack=llama_setup.no_repack, truncated_output_retries=llama_setup.retries,
                                    binaries=str(llama_setup.binaries.completion.parent),
                                    timing="llama.cpp rows: prompt + decode by llama.cpp's own timing lines "
                                           "(model load excluded); wall tok/s: the whole process",
                                    llama_bench=reference and reference.__dict__)
        if reference is not None:
            from .bench_llamacpp import best_vs_llama_bench

            settings["llamacpp"]["best_vs_llama_bench"] = best_vs_llama_bench(reference, summaries)
    print_table(summaries, settings)
    if reference is not None:
        from .bench_llamacpp import print_reference

        print_reference(reference, summaries, console)
    if k_sweep is not None:
        from ..bench.report import k_sweep_rows

        print_k_sweep(k_sweep_rows(summaries))
    if json_out:
        from ..bench.runner import BenchResult

        json_out.write_text(json.dumps(BenchResult(machine_info(), settings, summaries, samples).to_dict(), indent=1))
        err.print(f"[dim]wrote {json_out}[/]")
    if plot:
        from ..bench.report import plot_speedups

        plot_speedups(summaries, plot)
        err.print(f"[dim]wrote {plot}[/]")


def leaplm_exactness(target) -> str:
    """What greedy speculation promises on this target (engine.Engine.exactness)."""
    from ..engine.engine import exactness_of

    return exactness_of(target)


def print_table(summaries, settings) -> None:
    t = Table(title=f"leaplm bench: {settings['max_new_tokens']} new tokens, temperature {settings['temperature']}, "
                    f"{settings['rounds']} rounds x {settings['prompts']} prompts")
    external = any(s.wall_tokens_per_s is not None for s in summaries)
    structured = any(s.valid_rate is not None for s in summaries)
    cols = ["workload", "config", "tokens/s", "speedup vs none", "acceptance", "mean acc. len", "= none"]
    cols += ["valid", "grammar ms/token"] if structured else []
    cols += ["wall tok/s", "own decode tok/s"] if external else []
    for col in cols:
        t.add_column(col, justify="right" if col not in ("workload", "config") else "left")
    f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"
    for s in summaries:
        same = "-" if s.identical is None else ("yes" if s.identical else "NO")
        if s.common_prefix is not None:      # another engine's text: the leading tokens it reproduces
            same = f"{same} {s.common_prefix:.0f}/{s.compared_tokens:.0f} (min {s.common_prefix_min})"
        row = [s.workload, s.config, f(s.tokens_per_s, 1), f(s.speedup) + ("x" if s.speedup else ""),
               f(s.acceptance_rate), f(s.mean_accepted_length), same]
        if structured:
            grammar = "-" if s.grammar_ms_per_token is None else \
                f"{s.grammar_ms_per_token:.2f} ({100 * s.grammar_share:.1f}%)"
            row += [f(s.valid_rate), grammar]
        t.add_row(*row, *([f(s.wall_tokens_per_s, 1), f(s.decode_tokens_per_s, 1)] if external else []))
    console.print(t)
    if structured:
        console.print("[dim]+schema rows: speedup and '= none' against the constrained plain row (none +schema, "
                      "forced_tokens=0 when given); valid: outputs that open with a JSON value valid against the "
                      "prompt's schema; grammar: time in the grammar per new token (share of decoding time)[/]")
    if external:
        console.print("[dim]llama.cpp rows: tokens/s from llama.cpp's own timing lines (prompt + decode, model load "
                      "excluded), speedup paired with leaplm none; '= none': leaplm none's greedy tokens reproduced "
                      "(median/compared, up to none's first EOS), identity across engines is not expected on "
                      "quantized weights[/]")


def sweep_configs(configs: list[tuple[str, str, dict]], k_max: int) -> list[tuple[str, str, dict]]:
    """none, then per method: adaptive (K at most k_max), and fixed K = 1..k_max (labels the report parses)."""
    out = [c for c in configs if c[1] == "none"][:1]
    for _, method, opts in configs:
        if method == "none":
            continue
        out.append((f"{method} adaptive", method, {**opts, "k": k_max, "adaptive_k": True}))
        out += [(f"{method} k={j} fixed", method, {**opts, "k": j, "adaptive_k": False}) for j in range(1, k_max + 1)]
    return out


def print_k_sweep(rows) -> None:
    t = Table(title="adaptive K vs fixed K (speedups vs none, medians of paired ratios)")
    for col in ("workload", "method", "adaptive", "best fixed K", "best fixed", "adaptive / best", "adaptive / none"):
        t.add_column(col, justify="left" if col in ("workload", "method") else "right")
    for r in rows:
        t.add_row(r.workload, r.method, f"{r.adaptive:.2f}x", str(r.best_k), f"{r.best:.2f}x",
                  f"{r.adaptive / r.best:.3f}", f"{r.adaptive:.2f}x")
    console.print(t)


@bench_app.command("memory")
def bench_memory(
    model_dir: Path = typer.Option(Path.home() / ".cache/leaplm/bench/llama-3.2-1b-random", "--model-dir",
                                   help="Where the random-weight checkpoint is written (once) and read."),
    shape: str = typer.Option("llama-3.2-1b", help="Model shape (config) of the random checkpoint."),
    dtype: str = typer.Option("bfloat16", help="Weights and compute dtype (bfloat16 halves the weights' RSS)."),
    prompt_tokens: int = typer.Option(200, "--prompt-tokens"),
    new_tokens: int = typer.Option(64, "--new-tokens"),
    requests: int = typer.Option(8, help="serve: completions sent, 4 at a time."),
    port: int = typer.Option(0, help="serve's port (0: a free one)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the figures here."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Measure `leaplm generate` on this model (a "
                                        "GGUF file, a checkpoint directory or a catalog name such as smollm2) as "
                                        "it runs by default, instead of the random long-context shape."),
) -> None:
    """Peak RSS of `leaplm generate` and `leaplm serve` on a long-context shape (Llama-3.2-1B's 131072 positions
    by default, random weights), next to the KV cache preallocating every position would take; with --model, of
    `leaplm generate` on that model."""
    from ..bench.memory import SHAPES, figures_dict, run_memory_bench, run_model_memory_bench

    if model is not None:
        from ..models.catalog import resolve_model_name

        try:
            path = resolve_model_name(model)
        except ConfigError as e:
            fail(f"--model: {e.message}")
        if not Path(path).expanduser().exists():
            fail(f"--model: {model!r} is not a local file or directory")
        figs = run_model_memory_bench(path, prompt_tokens, new_tokens)
        t = Table(title=f"peak RSS, {prompt_tokens} prompt + {new_tokens} new tokens")
        for col in ("command", "peak RSS MB", "KV cache peak MB", "model file(s) MB"):
            t.add_column(col, justify="left" if col == "command" else "right")
        for f in figs:
            t.add_row(f.command, f"{f.peak_rss_bytes / 1e6:.0f}", f"{(f.kv_cache_peak_bytes or 0) / 1e6:.1f}",
                      f"{f.weights_bytes / 1e6:.0f}")
        console.print(t)
        if json_out:
            json_out.write_text(json.dumps(figures_dict(figs, dict(model=model, prompt_tokens=prompt_tokens,
                                                                   new_tokens=new_tokens)), indent=1))
        return
    if shape not in SHAPES:
        fail(f"--shape: one of {', '.join(SHAPES)}, got {shape!r}")
    figs = run_memory_bench(model_dir, shape, dtype, prompt_tokens, new_tokens, port, requests)
    t = Table(title=f"peak RSS, {shape} shape ({dtype}, random weights), {prompt_tokens} prompt + {new_tokens} "
                    f"new tokens")
    for col in ("command", "peak RSS GB", "KV cache peak MB", "preallocated cache GB", "weights GB"):
        t.add_column(col, justify="left" if col == "command" else "right")
    for f in figs:
        t.add_row(f.command, f"{f.peak_rss_bytes / 1e9:.2f}", f"{(f.kv_cache_peak_bytes or 0) / 1e6:.1f}",
                  f"{f.preallocated_cache_bytes / 1e9:.1f}", f"{f.weights_bytes / 1e9:.2f}")
    console.print(t)
    if json_out:
        json_out.write_text(json.dumps(figures_dict(figs, dict(shape=shape, dtype=dtype, prompt_tokens=prompt_tokens,
                                                               new_tokens=new_tokens, requests=requests)), indent=1))


@bench_app.command("report")
def bench_report(
    results: Path = typer.Option(Path("docs/results"), "--results", help="Folder of result JSON files."),
    out: Optional[Path] = typer.Option(None, "--out", help="Markdown file written (default: README.md in the "
                                       "--results folder); '-' prints it."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 when the markdown file differs from "
                               "what the JSON files render to."),
) -> None:
    """Render every result JSON file (`leaplm bench --json`, `--roofline`, `bench serve`, `bench memory`,
    llama-bench's JSON and hand-written records) into markdown tables, one section per file."""
    from ..bench.report import results_markdown

    if not results.is_dir():
        fail(f"--results: {str(results)!r} is not a directory")
    try:
        text = results_markdown(results, "leaplm bench report" + (f" --results {results}"
                                                                  if results != Path("docs/results") else ""))
    except ValueError as e:
        fail(f"--results: {e}")
    if out is not None and str(out) == "-":
        typer.echo(text, nl=False)
        return
    path = out or results / "README.md"
    if check:
        if not path.exists() or path.read_text() != text:
            err.print(f"{path} is not what `leaplm bench report` renders from {results}: run it to update")
            raise typer.Exit(1)
        return
    path.write_text(text)
    err.print(f"wrote {path} ({len(list(results.glob('*.json')))} result files)")

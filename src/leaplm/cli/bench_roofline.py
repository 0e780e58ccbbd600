"""`leaplm bench --roofline`: builds the engines, runs bench/roofline.py, prints the tables."""
from __future__ import annotations

import dataclasses
import json

import torch
from rich.table import Table

from ..config import ConfigError, SamplingParams
from .common import wide as console



def run_roofline(*, model, draft, configs, k, workloads, prompts, max_new_tokens, rounds, dtype, quantization,
                 json_out, fail, backend: str = "auto", plot=None, llamacpp=None, llamacpp_model=None) -> None:
    """llamacpp: llama.cpp's binaries (--baselines llamacpp): leaplm's one-token forward paired with llama-bench's
    pp1 on the same GGUF file (llamacpp_model, default the target)."""
    from ..bench.roofline import (Roofline, break_even, bytes_per_forward, forward_costs, method_costs,
                                  stream_bandwidth)
    from ..bench.workloads import as_chat, fit_to_context, get_workload
    from ..engine.engine import Engine, draft_quantization
    from ..models import embedded, load_model
    from ..models.loading import draft_backend
    from ..quant.apply import check_quantization

    try:
        check_quantization(quantization)
        target_name = model or embedded.default_target()
        target = load_model(target_name, dtype=dtype, field="model", quantization=quantization, backend=backend)
        # no --draft: as in the benchmark, the embedded default or the shipped draft trained for this target
        draft_name = draft or (embedded.default_draft() if model is None else embedded.draft_for(target.tokenizer))
        room = target.model.max_len - max_new_tokens - max(k, 8) - 2
        wl = [fit_to_context(as_chat(get_workload(w.strip(), prompts), target.tokenizer, target_name),
                             target.tokenizer, room) for w in workloads.split(",") if w.strip()]
        engines, drafts = {}, {}
        for label, method, opts in configs:
            d = None
            if method == "draft":
                dn = opts.pop("draft", None) or draft_name
                if dn is None:
                    fail("--draft: method draft needs a draft model")
                if dn not in drafts:
                    drafts[dn] = load_model(dn, dtype=dtype, field="draft",
                                            quantization=draft_quantization(quantization, dn),
                                            backend=draft_backend(backend))
                d = drafts[dn]
            engines[label] = Engine(target, draft=d, method=method, **opts)
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}")
    m = target.model
    q = getattr(m, "quantized", {})
    kernel = (next(iter(q.values())).backend if q else "F.linear") + (
        f" ({_ext_why()})" if q and next(iter(q.values())).backend == "extension" else "")
    if target.backend == "llamacpp":
        kernel = "libllama (llama.cpp's kernels, the file's own weight types)"
    nbytes = m.bytes_per_forward() if target.backend == "llamacpp" else bytes_per_forward(m)
    bw = stream_bandwidth()
    floor = nbytes / (bw * 1e9) * 1e3
    rep = Roofline(target_name, quantization, kernel, nbytes, bw, floor, torch.get_num_threads())
    rep.forwards = forward_costs(m)
    block_curves(rep, m.args)
    from ..models.gguf import is_gguf

    if is_gguf(target.path):
        from ..bench.llamacpp_costs import main_weight_type

        rep.weight_type = main_weight_type(target.path)
    if q and target.backend != "llamacpp":  # leaplm's whole forward on its quantized weights, per T
        from ..bench.roofline import forward_curve

        wt = {"int8": "Q8_0", "int4": "Q4_1"}.get(quantization) or rep.weight_type    # gguf: the file's own
        rep.curves.append(forward_curve(m, wt, bw, macs_per_s=rep.int8_GMACs * 1e9))
        if m.capabilities.argmax_head:      # what a greedy verify block costs (no logits written)
            rep.curves.append(forward_curve(m, wt, bw, macs_per_s=rep.int8_GMACs * 1e9, argmax=True))
    if target.backend == "llamacpp":        # libllama's whole forward per weight type, beside the int8 kernel's
        from ..bench.llamacpp_costs import libllama_curves

        rep.curves += libllama_curves(target.path, bw, macs_per_s=rep.int8_GMACs * 1e9)
    if llamacpp is not None:
        from ..bench.llamacpp import llama_bench_ms, llama_bench_pp1_command
        from ..bench.roofline import pair_one_token

        gguf = llamacpp_model or target.path
        if not is_gguf(gguf):
            fail(f"--llamacpp-model: llama-bench runs a GGUF file; {gguf} is not one")
        cmd = llama_bench_pp1_command(llamacpp, str(gguf), torch.get_num_threads())
        rep.one_token_vs_llamacpp = pair_one_token(m, lambda: llama_bench_ms(cmd), command=" ".join(cmd))
    prompts_all = [p for w in wl for p in w.prompts]
    rep.methods = method_costs(engines, prompts_all, max_new_tokens, rounds, floor, SamplingParams)
    if rep.weight_type:
        rep.break_even = break_even(rep.methods, rep.curves, rep.weight_type)
    print_roofline(rep)
    if json_out:
        json_out.write_text(json.dumps(dataclasses.asdict(rep), indent=1))
    if plot:
        from ..bench.report import plot_block_costs

        plot_block_costs(rep, plot)
        console.print(f"[dim]wrote {plot}[/]")


CURVE_BYTES = 1 << 30     # the most random weights a per-type block-cost curve may build


def block_curves(rep, args) -> None:
    """leaplm's int8 kernel's block-cost curve per weight type, and the int8 compute rate, into `rep`."""
    from ..kernels.build import load
    from ..bench.roofline import KERNEL_BLOCK_BYTES, WEIGHT_TYPES, int8_rate, kernel_block_costs, linear_shapes

    ext = load()
    if ext is None or ext.path == 0:
        rep.curves_note = "no block-cost curve for leaplm's int8 kernel: " + (
            "the C++ extension is unavailable" if ext is None else ext.why)
        return
    rep.int8_GMACs = round(int8_rate(ext) / 1e9, 1)
    shapes = linear_shapes(args)
    weights = sum(n * k for n, k in shapes)
    for wt in WEIGHT_TYPES:
        need = weights // 32 * KERNEL_BLOCK_BYTES[wt]
        if need > CURVE_BYTES:         # random weights of every linear beside the model: the file's curve suffices
            rep.curves_note += f"{wt}: no per-type curve ({need / 2**30:.1f} GiB of random weights beside the " \
                               f"model; the whole-forward curve is on the file's own blocks). "
            continue
        rep.curves.append(kernel_block_costs(shapes, wt, rep.bandwidth_GBps, rep.int8_GMACs * 1e9))


def _ext_why() -> str:
    from ..kernels.build import load

    ext = load()
    return ext.why if ext else "unavailable"


def print_roofline(r) -> None:
    console.print(f"[bold]roofline[/] {r.model} | quantization {r.quantization or 'none'} | linears: {r.kernel}")
    console.print(f"bytes read per forward {r.weight_bytes / 1e6:.1f} MB | streaming bandwidth {r.bandwidth_GBps:.2f} "
                  f"GB/s (1 token through F.linear over 256 MB fp32, {r.threads} threads) | floor "
                  f"{r.floor_ms:.2f} ms per forward")
    t = Table(title="forward over T tokens (after 64 cached)")
    for col in ("T", "ms", "vs T=1", "vs floor"):
        t.add_column(col, justify="right")
    for f in r.forwards:
        t.add_row(str(f.tokens), f"{f.ms:.2f}", f"{f.vs_one:.2f}x", f"{f.ms / r.floor_ms:.2f}x")
    console.print(t)
    print_curves(r)
    if r.one_token_vs_llamacpp is not None:
        p = r.one_token_vs_llamacpp
        console.print(f"one token: leaplm {p.leaplm_ms:.2f} ms, llama-bench pp1 {p.llama_ms:.2f} ms: leaplm takes "
                      f"{p.ratio:.2f}x llama.cpp's time (median of {len(p.rounds)} alternating rounds; {p.command})")
    t = Table(title="decode time per generated token (medians over requests; rest = host work between the stages)")
    for col in ("config", "ms/token", "propose", "score", "verify", "commit", "rest", "mean acc. len", "vs floor"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for mc in r.methods:
        t.add_row(mc.config, f"{mc.ms_per_token:.2f}", f"{mc.propose_ms:.2f}", f"{mc.score_ms:.2f}",
                  f"{mc.verify_ms:.2f}", f"{mc.commit_ms:.2f}", f"{mc.rest_ms:.2f}", f"{mc.mean_accepted_length:.2f}", f"{mc.vs_floor:.2f}x")
    console.print(t)
    if r.break_even:
        t = Table(title=f"where speculation can pay ({r.weight_type}): a step verifying K drafts scores K + 1 tokens; "
                        "it pays for that forward only where the mean accepted length exceeds the block's cost")
        for col in ("config", "K + 1", "kernel", "block cost (x one token)", "mean acc. len", "pays"):
            t.add_column(col, justify="left" if col in ("config", "kernel") else "right")
        for b in r.break_even:
            t.add_row(b.config, str(b.block_tokens), b.kernel, f"{b.block_cost:.2f}x", f"{b.mean_accepted_length:.2f}",
                      "yes" if b.pays else "no")
        console.print(t)


def print_curves(r) -> None:
    """Per weight type: each kernel's block-cost curve over T beside the bandwidth and int8 compute floors."""
    if r.curves_note:
        console.print(r.curves_note)
    if not r.curves:
        return
    console.print(f"int8 compute rate {r.int8_GMACs:.1f} G multiply-adds/s ({r.threads} threads, the kernel's "
                  f"dot-product instruction, no memory traffic)")
    for wt in dict.fromkeys(c.weight_type for c in r.curves):
        curves = [c for c in r.curves if c.weight_type == wt]
        t = Table(title=f"{wt}: one forward over T tokens, the linear layers alone ('leaplm int8') or whole "
                        "('forward') (ms; x = vs the first T)")
        t.add_column("T", justify="right")
        for c in curves:
            t.add_column(f"{c.kernel} ({c.weight_bytes / 1e6:.0f} MB)", justify="right")
        base = curves[0]
        t.add_column(f"bandwidth floor ({base.weight_bytes / 1e6:.0f} MB)", justify="right")
        t.add_column("int8 compute floor", justify="right")
        at = [dict(zip(c.tokens, zip(c.ms, c.vs_one))) for c in curves]
        for i, T in enumerate(base.tokens):
            cells = [f"{d[T][0]:.2f} ({d[T][1]:.2f}x)" if T in d else "-" for d in at]
            floor = base.compute_floor_ms[i] if i < len(base.compute_floor_ms) else None   # int8 types only
            t.add_row(str(T), *cells, f"{base.bandwidth_floor_ms:.2f}", "-" if floor is None else f"{floor:.2f}")
        console.print(t)

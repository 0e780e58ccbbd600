"""`leaplm bench --baselines llamacpp`: which GGUF files llama.cpp runs, and what is reported after the run."""
from __future__ import annotations

import logging
from pathlib import Path

from rich.table import Table

from ..bench.llamacpp import (LlamaCppBinaries, LlamaCppOutputError, LlamaCppSetup, judge_identity, probe_repack,
                              prompt_token_mismatches, run_llama_bench)
from ..config import ConfigError

log = logging.getLogger(__name__)


def _as_gguf(path: str, workdir: str, name: str, tensor_type: str, tokenizer_from: str | None, field: str,
             fail) -> str:
    """`path` when it is a GGUF file, else the checkpoint written as one in workdir (models/gguf_export.py)."""
    from ..models.gguf import is_gguf
    from ..models.gguf_export import export_gguf

    if is_gguf(path):
        return path
    try:
        return str(export_gguf(path, str(Path(workdir) / f"{name}-{tensor_type}.gguf"), tensor_type,
                               tokenizer_from).path)
    except ConfigError as e:
        fail(f"--{field}: {Path(path).name} cannot be written as GGUF for llama.cpp ({e.message}); pass a GGUF "
             f"file with --{field}")


def llamacpp_setup(bins: LlamaCppBinaries, target, quantization: str | None, draft_path: str | None,
                   llamacpp_model: str | None, llamacpp_draft: str | None, threads: int, context: int, workdir: str,
                   workloads, fail) -> LlamaCppSetup:
    """The GGUF files for llama.cpp: the target's own file when it is one; else the target written as f32 (q8_0
    under --quantization int8, the closest llama.cpp type); the draft as q8_0 with the target file's tokenizer."""
    if quantization == "int4" and not llamacpp_model:
        log.warning("llama.cpp has no type equal to leaplm's int4 here; it runs the target as f32 "
                    "(pass --llamacpp-model for another file)")
    model = llamacpp_model or _as_gguf(target.path, workdir, "target", "q8_0" if quantization == "int8" else "f32",
                                       None, "llamacpp-model", fail)
    draft = None
    if llamacpp_draft or draft_path:
        draft = llamacpp_draft or _as_gguf(draft_path, workdir, "draft", "q8_0", model, "llamacpp-draft", fail)
    for field, p in (("llamacpp-model", model), ("llamacpp-draft", draft)):
        if p is not None and not Path(p).is_file():
            fail(f"--{field}: {p!r} is not a file")
    setup = LlamaCppSetup(bins, model, threads, context, draft)
    prompt = Path(workdir) / "probe.txt"
    prompt.write_bytes(workloads[0].prompts[0].encode("utf-8"))
    probe_repack(setup, str(prompt))
    return setup


def finish_llamacpp(setup: LlamaCppSetup, summaries, samples, target, workloads, err):
    """Identity against leaplm none, a warning for prompts tokenized differently, and llama-bench tg128."""
    judge_identity(summaries, samples, target.tokenizer, "none", set(target.eos_token_ids))
    prompts = {(w.name, i): p for w in workloads for i, p in enumerate(w.prompts)}
    bad = prompt_token_mismatches(samples, target.tokenizer, target.bos_id, prompts)
    if bad:
        err.print(f"[yellow]warning:[/] llama.cpp tokenized {len(bad)} prompts differently: {'; '.join(bad[:4])}")
    try:
        return run_llama_bench(setup)
    except LlamaCppOutputError as e:
        err.print(f"[yellow]warning:[/] llama-bench failed, no tg128 reference: {e}")
        return None


def best_vs_llama_bench(fig, summaries) -> dict[str, dict]:
    """Per workload, leaplm's configuration of the highest decode rate (new tokens / decoding seconds, prefill
    excluded, as llama-bench's tg figure excludes it) against llama-bench's tg figure: what the goal 'the best
    configuration >= N x llama.cpp's plain decoding' reads. Rows of other engines are left out."""
    out: dict[str, dict] = {}
    for s in summaries:
        if s.decode_tokens_per_s is None or s.wall_tokens_per_s is not None:
            continue
        best = out.get(s.workload)
        if best is None or s.decode_tokens_per_s > best["decode_tokens_per_s"]:
            out[s.workload] = {"config": s.config, "decode_tokens_per_s": s.decode_tokens_per_s,
                               "vs_llama_bench": s.decode_tokens_per_s / fig.tokens_per_s}
    return out


def print_reference(fig, summaries, console) -> None:
    """llama-bench tg128 (no prompt, llama.cpp's own repetitions) beside leaplm none's tokens/s per workload, and
    leaplm's fastest configuration by decode rate against it."""
    t = Table(title=f"reference: llama-bench tg{fig.n_gen} ({fig.model_type}, {fig.repetitions} repetitions, "
                    "empty context)")
    for col in ("workload", "leaplm none tokens/s", f"llama-bench tg{fig.n_gen} tokens/s", "llama-bench / none",
                "leaplm best decode tok/s (config)", f"best / tg{fig.n_gen}"):
        t.add_column(col, justify="left" if col == "workload" else "right")
    best = best_vs_llama_bench(fig, summaries)
    for s in summaries:
        if s.config == "none":
            b = best.get(s.workload)
            t.add_row(s.workload, f"{s.tokens_per_s:.1f}", f"{fig.tokens_per_s:.1f} ± {fig.stddev:.1f}",
                      f"{fig.tokens_per_s / s.tokens_per_s:.2f}x",
                      f"{b['decode_tokens_per_s']:.1f} ({b['config']})" if b else "-",
                      f"{b['vs_llama_bench']:.2f}x" if b else "-")
    console.print(t)

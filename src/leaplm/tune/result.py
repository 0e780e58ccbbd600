"""What `leaplm tune` reports: the measured rows, the decision per concurrency level and the commands that serve
it, as one JSON-ready dict (cli/tune.py prints it as tables)."""
from __future__ import annotations

import time
from dataclasses import asdict

ALL_METHODS = ("draft", "ngram", "suffix", "layerskip", "lookahead", "eagle", "medusa")


def build_result(target, model, drafts, draft_paths, cset, plan, samples, positions, settings, min_gain, w,
                 max_len, started) -> dict:
    from ..bench.runner import machine_info, summarize
    from .candidates import Candidate
    from .memory import option_memory
    from .recommend import Row, decide, step_of

    by_label: dict[str, Candidate] = {c.label: c for c in [cset.baseline] + plan.measured}
    firsts: dict[str, Candidate] = {}
    for c in cset.ordered:                          # each family's screening K ("pick the draft")
        firsts.setdefault(c.family, c)
    screening = set(firsts.values())
    rows = []
    from ..heads.loader import default_head_dir

    tried = {c.method for c in cset.ordered}
    heads = {m: default_head_dir(target, m) for m in ("eagle", "medusa") if m in tried}
    for s in summarize(samples, "none"):
        c = by_label[s.config]
        level = int(s.workload.split("=")[1])
        mem = option_memory(c.method, drafts.get(c.draft_label) if c.draft_label else None, rows=level,
                            context=max_len, dtype=settings.dtype, head_dir=heads.get(c.method))
        rows.append(Row(level, c, step_of(c, screening), s.tokens_per_s, s.speedup, s.acceptance_rate,
                        s.mean_accepted_length, s.identical if settings.temperature == 0 else None, s.samples,
                        mem.total_mb, mem.note, positions.get((c.label, level)) or []))
    dec = decide(rows, settings.levels, min_gain, model, draft_paths, settings.adaptive_k)
    return {
        "command": "leaplm tune", "model": model or "embedded target", "workload": w.name,
        "machine": machine_info(), "settings": asdict(settings) | {"min_gain": min_gain, "context": max_len},
        "elapsed_s": round(time.perf_counter() - started, 1), "setup_s": round(plan.setup_s, 1),
        "minimum_budget_s": plan.minimum_s, "rounds": 1 + max((s.round for s in samples), default=0),
        "skipped": cset.skipped + plan.refused, "unmeasured": [c.label for c in plan.unmeasured],
        "dropped_after_screening": plan.dropped_after_screening,
        "rows": [{"concurrency": r.level, "config": r.candidate.label, "method": r.candidate.method,
                  "k": r.candidate.k, "draft": r.candidate.draft_label, "step": r.step,
                  "tokens_per_s": r.tokens_per_s, "speedup": r.speedup, "acceptance_rate": r.acceptance_rate,
                  "mean_accepted_length": r.mean_accepted_length, "identical": r.identical, "samples": r.samples,
                  "memory_added_mb": round(r.memory_mb, 2), "memory_note": r.memory_note,
                  "acceptance_by_position": [round(a, 3) for a in r.acceptance_by_position]} for r in rows],
        "decision": {"speculate": dec.speculate,
                     "levels": [asdict(d) | {"choice": d.choice.label if d.choice else "off"} for d in dec.levels],
                     "serve": dec.serve_command, "python": dec.python, "vllm_style": dec.vllm_style,
                     "notes": dec.notes},
    }

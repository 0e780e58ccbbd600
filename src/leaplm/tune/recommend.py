"""From measured figures to a decision: per concurrency level the configuration with the best median speedup
over the baseline, or "off" when none beats the baseline by at least min_gain; then the flags that reproduce it.

The decision follows the production checklist, and every figure names the step it answers:
  1 baseline        tokens/s of plain decoding at each level (what speculation must beat)
  2 pick the draft  each method / draft at its screening K: which proposer this workload rewards
  3 tune K          the K grid of the methods that paid
  4 acceptance      acceptance and mean accepted length: the figures to watch in production (/metrics)
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from .candidates import Candidate
from .memory import MemoryCost

STEPS = {1: "1 baseline", 2: "2 pick the draft", 3: "3 tune K", 4: "4 watch acceptance"}


@dataclass
class Row:
    level: int
    candidate: Candidate
    step: str
    tokens_per_s: float
    speedup: float | None
    acceptance_rate: float | None
    mean_accepted_length: float | None
    identical: bool | None
    samples: int
    memory_mb: float
    memory_note: str
    acceptance_by_position: list[float] = field(default_factory=list)


@dataclass
class LevelDecision:
    level: int
    speculate: bool
    choice: Candidate | None            # None: off
    speedup: float | None               # the choice's (or the best candidate's, when off)
    acceptance_rate: float | None
    baseline_tokens_per_s: float
    best_label: str | None              # the best candidate measured, even when off
    reason: str


@dataclass
class Decision:
    levels: list[LevelDecision]
    speculate: bool                      # at any level
    serve_command: str
    python: str
    vllm_style: str
    notes: list[str]


def step_of(c: Candidate, screening: set[Candidate]) -> str:
    if c.method == "none":
        return STEPS[1]
    return STEPS[2] if c in screening else STEPS[3]


def credible_speedup(r: Row) -> float:
    """The measured speedup, capped by the mean accepted length: a step emits tau tokens for at least one target
    forward, so no configuration can beat plain decoding by more than tau; a higher figure is timing noise (a
    configuration whose K policy stopped drafting measures 1.0x +- noise, never a real gain)."""
    tau = r.mean_accepted_length
    return min(r.speedup, tau) if tau is not None else r.speedup


def decide_level(rows: list[Row], level: int, min_gain: float) -> LevelDecision:
    mine = [r for r in rows if r.level == level]
    base = next(r for r in mine if r.candidate.method == "none")
    cands = [r for r in mine if r.candidate.method != "none" and r.speedup is not None and r.identical is not False]
    best = max(cands, key=credible_speedup, default=None)
    if best is None:
        return LevelDecision(level, False, None, None, None, base.tokens_per_s, None,
                             "no speculative configuration was measured")
    if credible_speedup(best) < 1 + min_gain:
        return LevelDecision(level, False, None, best.speedup, best.acceptance_rate, base.tokens_per_s,
                             best.candidate.label, f"the best, {best.candidate.label}, reaches {best.speedup:.2f}x: "
                                                   f"below the {1 + min_gain:.2f}x that pays for its cost")
    return LevelDecision(level, True, best.candidate, best.speedup, best.acceptance_rate, base.tokens_per_s,
                         best.candidate.label, f"{best.speedup:.2f}x over plain decoding at acceptance "
                                               f"{best.acceptance_rate or 0:.2f}")


def flags_for(c: Candidate | None, model: str | None, draft_path: str | None, adaptive_k: bool) -> dict:
    """The leaplm serve command, the Python call and a vLLM-style command line for one configuration."""
    m = ["--model", model] if model else []
    if c is None:
        return {"serve": shlex.join(["leaplm", "serve", *m, "--method", "none"]),
                "python": f"Engine({model!r}, method='none')" if model else "Engine(method='none')",
                "vllm_style": shlex.join(["vllm", "serve", model or "<model>"]) + "   # no speculative config"}
    serve = ["leaplm", "serve", *m, "--method", c.method, "--k", str(c.k)]
    py = [repr(model) if model else "None"]
    if c.method == "draft":
        serve += ["--draft", draft_path or c.draft]
        py.append(f"draft={draft_path or c.draft!r}")
    if not adaptive_k:
        serve.append("--fixed-k")
    py += [f"method={c.method!r}", f"k={c.k}"] + ([] if adaptive_k else ["adaptive_k=False"])
    spec: dict = {"num_speculative_tokens": c.k}
    if c.method == "draft":
        spec["model"] = draft_path or c.draft
    elif c.method == "ngram":
        spec |= {"method": "ngram", "prompt_lookup_max": 4}
    else:
        spec["method"] = c.method
    vllm = shlex.join(["vllm", "serve", model or "<model>", "--speculative-config", json.dumps(spec)])
    if c.method in ("suffix", "lookahead", "layerskip"):
        vllm += f"   # vLLM may not offer {c.method}; leaplm: --speculative-method {c.method} --num-speculative-tokens {c.k}"
    return {"serve": shlex.join(serve), "python": f"Engine({', '.join(py)})", "vllm_style": vllm}


def decide(rows: list[Row], levels: list[int], min_gain: float, model: str | None, draft_paths: dict[str, str],
           adaptive_k: bool) -> Decision:
    decisions = [decide_level(rows, lv, min_gain) for lv in levels]
    on = [d for d in decisions if d.speculate]
    notes = []
    # the server runs one default configuration: the one chosen at the lowest level that speculates
    pick = on[0].choice if on else None
    f = flags_for(pick, model, draft_paths.get(pick.draft_label) if pick and pick.draft_label else None, adaptive_k)
    off_levels = [d.level for d in decisions if not d.speculate]
    if on and off_levels:
        notes.append(f"speculation does not pay at concurrency {', '.join(map(str, off_levels))}: the server's "
                     "batch policy lowers K (to 0) as the batch fills, so one configuration serves all levels; "
                     "serve with --method none if your traffic stays at those levels")
    if on:
        notes.append("step 4: in production watch leaplm_spec_decode_num_accepted_tokens / _num_draft_tokens and "
                     "leaplm_spec_decode_k on /metrics; "
                     "re-run tune when acceptance falls well below the figure above")
    return Decision(decisions, bool(on), f["serve"], f["python"], f["vllm_style"], notes)


def memory_mb(cost: MemoryCost) -> float:
    return cost.total_mb

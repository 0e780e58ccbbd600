"""Draft acceptance on held-out prompts: acceptance rate and mean accepted length for K = 1..8, greedy and
sampled, measured through the real engine with a fixed K (no adaptive K), so the figures describe the draft."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..config import SamplingParams


@dataclass
class AcceptanceRow:
    k: int
    temperature: float
    acceptance_rate: float          # accepted / drafted
    mean_accepted_length: float     # tokens per target forward, bonus included
    draft_tokens: int
    prompts: int


def eval_acceptance(target, draft, prompts: Sequence[str], ks: Sequence[int] = tuple(range(1, 9)),
                    temperatures: Sequence[float] = (0.0, 0.8), max_new_tokens: int = 64, seed: int = 0,
                    on_row: Callable[[AcceptanceRow], None] | None = None, method: str = "draft",
                    head: str | None = None) -> list[AcceptanceRow]:
    """target, draft: LoadedModel (load once, reuse; draft None for heads). method 'eagle' or 'medusa' measures
    a head (head: its directory, None = the one shipped for the target), K being its tree's node budget.
    Returns one row per (temperature, K)."""
    from ..engine.engine import Engine
    from ..engine.stats import GenerationStats

    rows = []
    for temp in temperatures:
        for k in ks:
            eng = Engine(target, draft=draft, method=method, k=k, adaptive_k=False, head=head)
            total = GenerationStats(method, k)
            for i, p in enumerate(prompts):
                sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temp, seed=seed + i, ignore_eos=True)
                total.merge(eng.generate(p, sp).stats)
            row = AcceptanceRow(k, temp, total.acceptance_rate, total.mean_accepted_length, total.draft_tokens,
                                len(prompts))
            rows.append(row)
            if on_row:
                on_row(row)
    return rows

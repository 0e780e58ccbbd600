"""The memory an option adds to the target alone: a draft's weights and its KV cache; the draft-free methods
add host-side tables only (n-gram indexes, the lookahead pool), and layer skip reuses the target's weights and
cache."""
from __future__ import annotations

from dataclasses import dataclass

from ..models import LoadedModel
from ..models.footprint import draft_footprint


@dataclass
class MemoryCost:
    weights_bytes: int                 # a draft's parameters
    cache_bytes: int                   # its KV cache at the given rows x context
    note: str

    @property
    def total_mb(self) -> float:
        return (self.weights_bytes + self.cache_bytes) / 2 ** 20


def option_memory(method: str, draft: LoadedModel | None, rows: int, context: int,
                  dtype: str = "float32", head_dir=None) -> MemoryCost:
    if method == "draft" and draft is not None:
        weights, per_row = draft_footprint(draft, context)
        return MemoryCost(weights, rows * per_row, f"draft weights + its KV cache ({rows} rows x {context} positions)")
    if method in ("eagle", "medusa") and head_dir is not None:
        from pathlib import Path

        weights = sum(p.stat().st_size for p in Path(head_dir).glob("*.safetensors"))
        note = "head weights (the target's embedding and lm_head are shared)"
        return MemoryCost(weights, 0, note + ("; plus one decoder layer of KV per row" if method == "eagle" else ""))
    if method == "layerskip":
        return MemoryCost(0, 0, "none: the draft pass is the target with layers skipped, same weights and cache")
    if method in ("ngram", "suffix", "lookahead"):
        return MemoryCost(0, 0, "host tables only (kilobytes per request)")
    return MemoryCost(0, 0, "-")

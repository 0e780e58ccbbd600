"""The memory an option adds to the target alone: a draft's weights and its KV cache; the draft-free methods
add host-side tables only (n-gram indexes, the lookahead pool), and layer skip reuses the target's weights and
cache."""
from __future__ import annotations

from dataclasses import dataclass

from ..models import LoadedModel

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class MemoryCost:
    weights_bytes: int                 # a draft's parameters
    cache_bytes: int                   # its KV cache at the given rows x context
    note: str

    @property
    def total_mb(self) -> float:
        return (self.weights_bytes + self.cache_bytes) / 2 ** 20


def kv_cache_bytes(config: dict, rows: int, context: int, dtype: str = "float32") -> int:
    """K and V per layer: [rows, kv_heads, context, head_dim]."""
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * layers * rows * kv * context * head_dim * _BYTES.get(dtype, 4)


def draft_footprint(draft: LoadedModel, context: int) -> tuple[int, int]:
    """(weights bytes, KV-cache bytes per request row at `context` positions) of a loaded draft, from its actual
    parameters' element size (the dtype it was loaded in)."""
    params = list(draft.model.parameters()) if hasattr(draft.model, "parameters") else []
    weights = sum(p.numel() * p.element_size() for p in params) if params else draft.n_params * 4
    elem = params[0].element_size() if params else 4
    dtype = {2: "float16", 4: "float32"}.get(elem, "float32")
    return weights, kv_cache_bytes(draft.config, 1, context, dtype)


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

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


def option_memory(method: str, draft: LoadedModel | None, rows: int, context: int,
                  dtype: str = "float32") -> MemoryCost:
    if method == "draft" and draft is not None:
        return MemoryCost(draft.n_params * _BYTES.get(dtype, 4), kv_cache_bytes(draft.config, rows, context, dtype),
                          f"draft weights + its KV cache ({rows} rows x {context} positions)")
    if method == "layerskip":
        return MemoryCost(0, 0, "none: the draft pass is the target with layers skipped, same weights and cache")
    if method in ("ngram", "suffix", "lookahead"):
        return MemoryCost(0, 0, "host tables only (kilobytes per request)")
    return MemoryCost(0, 0, "-")

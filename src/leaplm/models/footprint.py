"""The memory a loaded model takes: its weights and its KV cache per request row (the server's metrics and
`leaplm tune` report them)."""
from __future__ import annotations

import ctypes
import ctypes.util

from .base import LoadedModel

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    if draft.backend == "llamacpp":            # libllama: the file's own weights, its KV cache's own type
        return draft.model.weight_bytes, draft.model.bytes_per_token * context
    params = list(draft.model.parameters()) if hasattr(draft.model, "parameters") else []
    weights = sum(p.numel() * p.element_size() for p in params) if params else draft.n_params * 4
    elem = params[0].element_size() if params else 4
    dtype = {2: "float16", 4: "float32"}.get(elem, "float32")
    return weights, kv_cache_bytes(draft.config, 1, context, dtype)


def return_freed_memory() -> None:
    """Hand the memory freed while loading back to the operating system (glibc's malloc_trim; elsewhere nothing).
    Loading leaves hundreds of MB freed but held by the allocator: building Gemma 3's tokenizer (262,144 tokens,
    514,906 merges) peaks 180 MB above what it keeps, converting a file's blocks into the kernel's layout passes
    through temporary arrays. Without this, resident memory stays at the peak."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass

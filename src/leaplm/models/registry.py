"""Which model_type runs natively; everything else goes through the transformers fallback adapter."""
from __future__ import annotations

NATIVE_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama"}


def native_family(model_type: str | None) -> str | None:
    return NATIVE_FAMILIES.get(model_type or "")

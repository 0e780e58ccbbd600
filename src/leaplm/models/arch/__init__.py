"""Model families as data: one description per family, looked up by Hugging Face model type
or GGUF architecture."""
from __future__ import annotations

from .base import Arch, LayerNames, with_gguf_implied
from .gemma3 import GEMMA3
from .llama import LLAMA, MISTRAL
from .qwen2 import QWEN2
from .qwen3 import QWEN3

FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3)
BY_MODEL_TYPE = {t: a for a in FAMILIES for t in a.model_types}
# llama.cpp's converter writes Mistral files as "llama"
BY_GGUF_ARCHITECTURE = {g: a for a in FAMILIES for g in a.gguf_architectures}


def arch_of(model_type: str | None) -> Arch | None:
    """The family of a Hugging Face model_type, None when the native model does not run it."""
    return BY_MODEL_TYPE.get(model_type or "")


def gguf_config(architecture: str, cfg: dict) -> dict:
    """A config dict read from a GGUF file of `architecture`, with what the family's files imply filled in."""
    arch = BY_GGUF_ARCHITECTURE.get(architecture)
    return cfg if arch is None else with_gguf_implied(arch, cfg)


__all__ = ["Arch", "LayerNames", "with_gguf_implied", "FAMILIES", "BY_MODEL_TYPE", "BY_GGUF_ARCHITECTURE", "arch_of", "gguf_config"]

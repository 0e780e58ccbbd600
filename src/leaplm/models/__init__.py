"""Target and draft models behind one protocol (base.CausalLM), loaded from Hugging Face checkpoints."""
from .base import CausalLM
from .loading import LoadedModel, load_model

__all__ = ["CausalLM", "LoadedModel", "load_model"]

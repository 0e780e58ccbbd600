"""Target and draft models behind one protocol (base.CausalLM), loaded from Hugging Face checkpoints."""
from .base import CausalLM, LoadedModel
from .loading import load_model

__all__ = ["CausalLM", "LoadedModel", "load_model"]

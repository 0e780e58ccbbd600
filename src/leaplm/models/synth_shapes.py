"""The shapes of published models, as data, for synthetic GGUF files (models/synth.py): dimensions only, no weights.

Each row is copied from the model's config.json on the Hugging Face hub (the `source` column names it): the
fields a forward's cost depends on. The tensor plan built from a row (synth.plan_tensors) has exactly the published
parameter count of each model (tests/models/test_synth.py checks it). Llama 3.1/3.2's "llama3" RoPE frequency
scaling is not written (llama.cpp's rope_freqs tensor: it changes the rotation angles, not the cost); Gemma 3's
sliding window is.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError


@dataclass(frozen=True)
class SynthShape:
    """One model's dimensions, as its config.json states them."""
    name: str
    arch: str                   # GGUF general.architecture: llama | qwen2 | gemma3
    hidden: int                 # hidden_size
    layers: int                 # num_hidden_layers
    heads: int                  # num_attention_heads
    kv_heads: int               # num_key_value_heads
    head_dim: int               # head_dim (hidden / heads where the config has none)
    intermediate: int           # intermediate_size
    vocab: int                  # vocab_size: rows of the embedding and of the output matrix
    tied: bool                  # tie_word_embeddings: no output.weight, the embedding is the head
    rope_theta: float           # rope_theta (Gemma 3: the global layers' base; its local layers use 10000)
    norm_eps: float             # rms_norm_eps
    context: int                # max_position_embeddings (GGUF context_length; the runtime picks its own n_ctx)
    source: str                 # where the numbers come from
    sliding_window: int = 0     # Gemma 3's local attention window (0: none)

    @property
    def q_rows(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.kv_heads * self.head_dim


SHAPES: dict[str, SynthShape] = {s.name: s for s in (
    SynthShape("Llama-3.2-1B", "llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 1e-5, 131072,
               "meta-llama/Llama-3.2-1B config.json"),
    SynthShape("Llama-3.2-3B", "llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0, 1e-5, 131072,
               "meta-llama/Llama-3.2-3B config.json"),
    SynthShape("Llama-3.1-8B", "llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 1e-5, 131072,
               "meta-llama/Llama-3.1-8B config.json"),
    SynthShape("Qwen2.5-7B", "qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False, 1000000.0, 1e-6, 131072,
               "Qwen/Qwen2.5-7B config.json"),
    SynthShape("Gemma-3-1B", "gemma3", 1152, 26, 4, 1, 256, 6912, 262144, True, 1000000.0, 1e-6, 32768,
               "google/gemma-3-1b-pt config.json", sliding_window=512),
)}


def shape_named(name: str, field: str = "shape") -> SynthShape:
    """A shape by its name (case-insensitive); ConfigError listing the known ones."""
    for k, s in SHAPES.items():
        if k.lower() == name.lower():
            return s
    raise ConfigError(field, f"unknown shape {name!r}; known: {', '.join(SHAPES)}")

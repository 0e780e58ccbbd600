"""Architectures of the embedded family (Hugging Face LlamaConfig keyword arguments)."""
from __future__ import annotations

# target ~34M parameters: fp32 weights (134 MB) far exceed the 36 MB last-level cache, so decode is memory-bound.
PRESETS: dict[str, dict] = {
    "target-34m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, tie_word_embeddings=False),
    # ~1/10 of the target
    "draft-3m": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=3,
                     num_key_value_heads=1, tie_word_embeddings=True),
    # ~1/30 of the target
    "draft-1m": dict(hidden_size=112, intermediate_size=320, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, tie_word_embeddings=True),
    # for tests: trains in seconds
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, tie_word_embeddings=True),
}


def llama_config(preset: str, vocab_size: int, eos_id: int, max_position_embeddings: int = 1024):
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise ValueError(f"model preset {preset!r} unknown; choose from {sorted(PRESETS)}")
    return LlamaConfig(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id,
                       max_position_embeddings=max_position_embeddings, rope_theta=10000.0,
                       rms_norm_eps=1e-5, **PRESETS[preset])

"""Qwen3: Qwen2 without the fixed q/k/v bias (attention_bias instead), RMSNorm on each head's q and k."""
from dataclasses import replace

from .base import LLAMA_GGUF, LLAMA_HF, Arch

QWEN3 = Arch(name="qwen3", model_types=("qwen3",), gguf_architectures=("qwen3",),
             hf_layer=replace(LLAMA_HF, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
             gguf_layer=replace(LLAMA_GGUF, q_norm="attn_q_norm", k_norm="attn_k_norm"),
             qk_norm=True, window="qwen")

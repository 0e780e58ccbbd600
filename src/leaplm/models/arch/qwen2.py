"""Qwen2: bias on q/k/v always (none on the output), sliding window on the layers layer_types names."""
from .base import LLAMA_GGUF, LLAMA_HF, Arch

QWEN2 = Arch(name="qwen2", model_types=("qwen2",), gguf_architectures=("qwen2",), hf_layer=LLAMA_HF,
             gguf_layer=LLAMA_GGUF, qkv_bias="always", o_bias=False, window="qwen")

"""Llama and Mistral: pre-norms, SiLU, optional biases (llama), a sliding window on every layer (mistral).
llama.cpp writes Mistral files as general.architecture "llama", with q/k rows in interleaved pairs."""
from .base import LLAMA_GGUF, LLAMA_HF, Arch

LLAMA = Arch(name="llama", model_types=("llama",), gguf_architectures=("llama",), hf_layer=LLAMA_HF,
             gguf_layer=LLAMA_GGUF, mlp_bias=True, gguf_paired_rope=True)
MISTRAL = Arch(name="mistral", model_types=("mistral",), gguf_architectures=("mistral",), hf_layer=LLAMA_HF,
               gguf_layer=LLAMA_GGUF, qkv_bias="never", o_bias=False, window="all", gguf_paired_rope=True)

"""The description of one model family, as data: what the native decoder's layer loop, the Hugging Face loader
and the GGUF loaders read instead of branching on a model type.

A family differs from Llama only in the fields below; everything else (GQA, RoPE kinds, biases, the fused q/k/v
and gate/up layout) is shared by the native model (models/llama.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerNames:
    """One layer's tensor names, relative to the layer's prefix (`model.layers.{i}.` in Hugging Face checkpoints,
    `blk.{i}.` in GGUF files). None: the family has no such tensor."""
    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str
    down: str
    attn_norm: str                      # the norm before attention
    mlp_norm: str                       # the norm before the MLP
    post_attn_norm: str | None = None   # after attention, before the residual add (Gemma)
    post_mlp_norm: str | None = None    # after the MLP, before the residual add (Gemma)
    q_norm: str | None = None           # RMSNorm over each head's q / k (Qwen3, Gemma 3)
    k_norm: str | None = None


@dataclass(frozen=True)
class Arch:
    """One model family. HF config keys are read as transformers' own config class reads them."""
    name: str
    model_types: tuple[str, ...]        # Hugging Face config.json model_type values
    gguf_architectures: tuple[str, ...] # GGUF general.architecture values
    hf_layer: LayerNames                # under model.layers.{i}.
    gguf_layer: LayerNames              # under blk.{i}.
    # the norms
    qk_norm: bool = False               # per-head RMSNorm on q and k, before RoPE
    post_norms: bool = False            # RMSNorm on the attention and MLP outputs before each residual add
    # Hugging Face stores w and computes x * (norm_offset + w); the native model computes x * w', so the HF loader
    # adds the offset once (GGUF files made by llama.cpp's converter already store offset + w; transformers' GGUF
    # reader subtracts it, so a GGUF read through transformers gets it added back by the same HF loader)
    norm_offset: float = 0.0
    # the attention
    qkv_bias: str = "config"            # 'always' | 'config' (attention_bias) | 'never'
    o_bias: bool = True                 # the output projection's bias follows attention_bias
    mlp_bias: bool = False              # mlp_bias in the config is honoured
    # how layers choose the sliding window: 'never' | 'all' (sliding_window on every layer) | 'qwen'
    # (use_sliding_window, max_window_layers, layer_types) | 'layer_types' (layer_types, from the config class)
    window: str = "never"
    local_rope_key: str | None = None   # config key: the RoPE base of sliding layers (Gemma 3: rope_local_base_freq)
    attn_scale_key: str | None = None   # config key: attention scale = key ** -0.5 (Gemma: query_pre_attn_scalar)
    # the embeddings and activations
    act_key: str = "hidden_act"         # config key of the MLP's activation
    default_act: str = "silu"
    embed_scale: bool = False           # embeddings times sqrt(hidden_size), rounded to the model's dtype
    tied_default: bool = False          # tie_word_embeddings when the config does not say
    bos_required: bool = False          # prompts must start with BOS (the model was never trained without it)
    gguf_paired_rope: bool = False      # llama.cpp's converter stores q/k rows as interleaved pairs (native layout)
    # Hugging Face config values a GGUF file of this family implies without storing them (llama.cpp's own
    # constants for the architecture): key -> a value, or the name of another config key to copy
    gguf_implied: dict = field(default_factory=dict)
    # config keys whose non-default values the native model does not implement (key -> the value it implements)
    refused: dict = field(default_factory=dict)


LLAMA_HF = LayerNames(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
                      gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj", attn_norm="input_layernorm",
                      mlp_norm="post_attention_layernorm")
LLAMA_GGUF = LayerNames(q="attn_q", k="attn_k", v="attn_v", o="attn_output", gate="ffn_gate", up="ffn_up",
                        down="ffn_down", attn_norm="attn_norm", mlp_norm="ffn_norm")


def with_gguf_implied(arch: Arch, cfg: dict) -> dict:
    """`cfg` (a Hugging Face config dict read from a GGUF file's metadata) with what the file implies filled in."""
    out = dict(cfg)
    for key, value in arch.gguf_implied.items():
        if out.get(key) is None:
            out[key] = out.get(value) if isinstance(value, str) else value
    return out

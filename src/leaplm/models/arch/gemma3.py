"""Gemma 3 (text): sliding-window layers interleaved with global ones (layer_types), each kind with its own RoPE
base; RMSNorm on q and k; norms before and after attention and the MLP; norms computing x * (1 + w); GELU-tanh;
embeddings times sqrt(hidden); attention scaled by query_pre_attn_scalar ** -0.5; a tied head; BOS first.

Names: Hugging Face's post_attention_layernorm is the norm AFTER attention here (Llama's is the one before the
MLP); llama.cpp names them post_attention_norm / ffn_norm / post_ffw_norm (gguf.constants, MODEL_ARCH.GEMMA3)."""
from .base import Arch, LayerNames

GEMMA3 = Arch(
    name="gemma3", model_types=("gemma3_text",), gguf_architectures=("gemma3",),
    hf_layer=LayerNames(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
                        gate="mlp.gate_proj", up="mlp.up_proj", down="mlp.down_proj", attn_norm="input_layernorm",
                        mlp_norm="pre_feedforward_layernorm", post_attn_norm="post_attention_layernorm",
                        post_mlp_norm="post_feedforward_layernorm", q_norm="self_attn.q_norm",
                        k_norm="self_attn.k_norm"),
    gguf_layer=LayerNames(q="attn_q", k="attn_k", v="attn_v", o="attn_output", gate="ffn_gate", up="ffn_up",
                          down="ffn_down", attn_norm="attn_norm", mlp_norm="ffn_norm",
                          post_attn_norm="post_attention_norm", post_mlp_norm="post_ffw_norm",
                          q_norm="attn_q_norm", k_norm="attn_k_norm"),
    qk_norm=True, post_norms=True, norm_offset=1.0, qkv_bias="config", window="layer_types",
    local_rope_key="rope_local_base_freq", attn_scale_key="query_pre_attn_scalar", act_key="hidden_activation",
    default_act="gelu_pytorch_tanh", embed_scale=True, tied_default=True, bos_required=True,
    # llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3) stores neither: sliding layers at base 10000, every sixth
    # layer global, attention scaled by head_dim ** -0.5 (27B aside, whose files say so in no key either)
    gguf_implied={"rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "query_pre_attn_scalar": "head_dim"},
    refused={"final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False},
)

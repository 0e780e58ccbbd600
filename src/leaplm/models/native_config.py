"""The native model's arguments and weights from a Hugging Face config and state dict, read through the family's
description (models/arch): no branch on a model type here or in the layer loop."""
from __future__ import annotations

import torch

from .native_args import ACTIVATIONS, ROPE_TYPES, LlamaArgs, interleave_rope_rows, rope_kind


def family(cfg: dict):
    """The models/arch description of a config's model_type (ValueError naming it when none)."""
    from .arch import arch_of

    arch = arch_of(cfg.get("model_type"))
    if arch is None:
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not a native family")
    return arch


def _window_layers(cfg: dict, arch, n: int) -> tuple[int | None, list[bool] | None]:
    """(sliding_window, which layers use it) as transformers' config class of the family decides."""
    sw = cfg.get("sliding_window")
    if arch.window == "never":
        return None, None
    if arch.window == "all":
        return sw, None
    if arch.window == "qwen":   # transformers: the window only with use_sliding_window, per layer_types
        if not cfg.get("use_sliding_window", False):
            sw = None
        types = cfg.get("layer_types") or ["sliding_attention" if sw is not None and i >= cfg.get("max_window_layers", n)
                                           else "full_attention" for i in range(n)]
    else:                       # 'layer_types': the config class fills them from sliding_window_pattern
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6)
                                           else "full_attention" for i in range(n)]
    layers = [t == "sliding_attention" for t in types]
    if sw is None or not any(layers):
        return None, None
    return sw, layers


def args_from_hf_config(cfg: dict) -> LlamaArgs:
    """LlamaArgs from a Hugging Face config.json dict (transformers 4.x and 5.x spellings), every field that
    changes the maths read as transformers' own classes read it, through the family's description (models/arch).
    Check native_blockers(cfg) first."""
    arch = family(cfg)
    mt = cfg.get("model_type")
    heads = cfg["num_attention_heads"]
    n = cfg["num_hidden_layers"]
    rope = cfg.get("rope_parameters") or {}
    per_type = isinstance(rope.get("full_attention"), dict)      # transformers 5: rope parameters per layer type
    full = rope["full_attention"] if per_type else rope
    theta = cfg.get("rope_theta") or full.get("rope_theta", 10000.0)
    scaling = cfg.get("rope_scaling") or (full if rope_kind(full) != "default" else None)
    sw, window_layers = _window_layers(cfg, arch, n)
    layer_theta = None
    if arch.local_rope_key is not None:
        local = cfg.get(arch.local_rope_key) or (rope.get("sliding_attention") or {}).get("rope_theta", 10000.0)
        types = cfg.get("layer_types") or [None] * n
        layer_theta = [local if t == "sliding_attention" else theta for t in types]
        if window_layers is not None and cfg.get("layer_types") is None:
            layer_theta = [local if w else theta for w in window_layers]
    bias = bool(cfg.get("attention_bias", False))
    qkv_bias = {"always": True, "never": False, "config": bias}[arch.qkv_bias]
    hidden = cfg["hidden_size"]
    eos = cfg.get("eos_token_id")
    return LlamaArgs(
        vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", arch.tied_default),
        attention_bias=qkv_bias, o_bias=bias and arch.o_bias, mlp_bias=bool(cfg.get("mlp_bias", False)) and arch.mlp_bias,
        hidden_act=cfg.get(arch.act_key) or arch.default_act, qk_norm=arch.qk_norm,
        sliding_window=sw, window_layers=window_layers, model_type=mt,
        eos_token_id=[eos] if isinstance(eos, int) else list(eos or []), hf_config=cfg,
        post_norms=arch.post_norms, embed_scale=hidden ** 0.5 if arch.embed_scale else None,
        attn_scale=cfg.get(arch.attn_scale_key, 256) ** -0.5 if arch.attn_scale_key else None,
        layer_rope_theta=layer_theta, norm_offset=arch.norm_offset,
    )


def native_blockers(cfg: dict) -> list[str]:
    """Fields of a native-family config that the native code does not implement, each as 'field: value'; the
    loader runs such a model through the transformers fallback instead (or refuses it, naming the field)."""
    out = []
    arch = family(cfg)
    act = cfg.get(arch.act_key) or arch.default_act
    if act not in ACTIVATIONS:
        out.append(f"{arch.act_key}: {act!r} (native: {', '.join(ACTIVATIONS)})")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    for kind in ([r for r in rope.values() if isinstance(r, dict)] or [rope]):   # per layer type (transformers 5)
        if rope_kind(kind) not in ROPE_TYPES:
            out.append(f"rope_scaling: rope_type {rope_kind(kind)!r} (native: {', '.join(ROPE_TYPES)})")
        prf = cfg.get("partial_rotary_factor", kind.get("partial_rotary_factor", 1.0))
        if prf not in (None, 1, 1.0):
            out.append(f"partial_rotary_factor: {prf}")
    sliding = (rope.get("sliding_attention") or {}) if isinstance(rope.get("sliding_attention"), dict) else {}
    if rope_kind(sliding) != "default":
        out.append(f"rope_parameters: sliding_attention rope_type {rope_kind(sliding)!r} (native: default)")
    for key, value in arch.refused.items():
        if cfg.get(key, value) != value:
            out.append(f"{key}: {cfg[key]!r} (native: {value!r})")
    if cfg.get("quantization_config"):
        out.append(f"quantization_config: {cfg['quantization_config'].get('quant_method', 'quantized')} weights")
    return out


def fuse_hf_state_dict(sd: dict[str, torch.Tensor], a: LlamaArgs) -> dict[str, torch.Tensor]:
    """Map Hugging Face parameter names onto this module's (fusing q/k/v and gate/up) by the family's names; norm
    weights get the family's norm_offset added here, once (x * (offset + w) becomes x * w')."""
    arch = family(a.hf_config or {"model_type": a.model_type})
    names = arch.hf_layer
    off = arch.norm_offset
    norm = (lambda w: w + off) if off else (lambda w: w)
    out = {"embed_tokens.weight": sd["model.embed_tokens.weight"], "norm.weight": norm(sd["model.norm.weight"])}
    out["lm_head.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    H, Hkv, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}."
        o = f"layers.{i}."
        q, k, v = (sd[p + n + ".weight"] for n in (names.q, names.k, names.v))
        out[o + "self_attn.qkv.weight"] = torch.cat([interleave_rope_rows(q, H, D), interleave_rope_rows(k, Hkv, D), v])
        if a.attention_bias:
            qb, kb, vb = (sd[p + n + ".bias"] for n in (names.q, names.k, names.v))
            out[o + "self_attn.qkv.bias"] = torch.cat([interleave_rope_rows(qb, H, D),
                                                       interleave_rope_rows(kb, Hkv, D), vb])
        out[o + "self_attn.o_proj.weight"] = sd[p + names.o + ".weight"]
        if a.o_bias:
            out[o + "self_attn.o_proj.bias"] = sd[p + names.o + ".bias"]
        if a.mlp_bias:
            out[o + "mlp.gate_up.bias"] = torch.cat([sd[p + names.gate + ".bias"], sd[p + names.up + ".bias"]])
            out[o + "mlp.down_proj.bias"] = sd[p + names.down + ".bias"]
        if a.qk_norm:
            out[o + "self_attn.q_norm.weight"] = interleave_rope_rows(norm(sd[p + names.q_norm + ".weight"]), 1, D)
            out[o + "self_attn.k_norm.weight"] = interleave_rope_rows(norm(sd[p + names.k_norm + ".weight"]), 1, D)
        if a.post_norms:
            out[o + "self_attn.post_norm.weight"] = norm(sd[p + names.post_attn_norm + ".weight"])
            out[o + "mlp.post_norm.weight"] = norm(sd[p + names.post_mlp_norm + ".weight"])
        out[o + "mlp.gate_up.weight"] = torch.cat([sd[p + names.gate + ".weight"], sd[p + names.up + ".weight"]])
        out[o + "mlp.down_proj.weight"] = sd[p + names.down + ".weight"]
        out[o + "input_layernorm.weight"] = norm(sd[p + names.attn_norm + ".weight"])
        out[o + "post_attention_layernorm.weight"] = norm(sd[p + names.mlp_norm + ".weight"])
    return out

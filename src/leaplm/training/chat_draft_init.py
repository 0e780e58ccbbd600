"""A chat draft's starting point: a narrow llama over the draft vocabulary whose embedding is the target's own
rows projected on their top principal directions, or ("cut-N") the target's first N layers copied from its
checkpoint or GGUF file."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ConfigError

# narrow llamas; the LM head and embedding are N x hidden (tied)
DRAFT_SHAPES: dict[str, dict] = {
    "chat-2x256": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=1),
    "chat-1x256": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=1),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1),
}
# "cut-N": the target's own first N layers, final norm and (tied) embedding rows of the draft vocabulary, copied
# from the target and then distilled: a draft that starts close to the target's early representation
CUT_PREFIX = "cut-"


def cut_layers(shape: str) -> int | None:
    """N of a "cut-N" shape, else None."""
    if not shape.startswith(CUT_PREFIX):
        return None
    n = shape[len(CUT_PREFIX):]
    return int(n) if n.isdigit() and int(n) >= 1 else None


def target_embedding(model: str) -> torch.Tensor:
    """[V, hidden] fp32 input embedding of the target (GGUF token_embd, or embed_tokens of a checkpoint)."""
    from ..models.gguf import is_gguf

    if is_gguf(model):
        from gguf import GGUFReader
        from gguf.quants import dequantize

        t = next(t for t in GGUFReader(model).tensors if t.name == "token_embd.weight")
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
    from ..models.loading import read_state_dict

    sd = read_state_dict(Path(model))
    key = next(k for k in sd if k.endswith("embed_tokens.weight"))
    return sd[key].float()


# llama.cpp tensor names -> Hugging Face names of one layer
_GGUF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _llama_cpp_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """[rows, cols] llama.cpp's interleaved rotary pairs -> Hugging Face's rotate-half rows, per head (the inverse of
    models/gguf_export.llama_cpp_permute)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def target_checkpoint(model: str, n_layers: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(Hugging Face config dict, fp32 state dict with Hugging Face names) of the target; with n_layers, only the
    embedding, the final norm and layers 0..n_layers-1 (a GGUF file dequantizes only those tensors)."""
    from ..models.gguf import is_gguf

    if is_gguf(model):
        from gguf import GGUFReader
        from gguf.quants import dequantize
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = _full_config(load_gguf_checkpoint(model, return_tensors=False)["config"])
        heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        sd = {}
        for t in GGUFReader(model).tensors:
            name = t.name.rsplit(".", 1)[0]
            if name == "token_embd":
                key = "model.embed_tokens.weight"
            elif name == "output_norm":
                key = "model.norm.weight"
            elif name.startswith("blk."):
                _, i, kind = name.split(".", 2)
                if kind not in _GGUF_LAYER or (n_layers is not None and int(i) >= n_layers):
                    continue
                key = f"model.layers.{i}.{_GGUF_LAYER[kind]}.weight"
            else:
                continue
            w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
            if name.endswith("attn_q"):
                w = _llama_cpp_unpermute(w, heads)
            elif name.endswith("attn_k"):
                w = _llama_cpp_unpermute(w, kv)
            sd[key] = w
        return cfg, sd
    from ..models.loading import read_state_dict

    sd = {k if k.startswith(("model.", "lm_head")) else f"model.{k}": v.float()
          for k, v in read_state_dict(Path(model)).items()}
    return json.loads((Path(model) / "config.json").read_text()), sd


def _full_config(cfg: dict) -> dict:
    """The full Hugging Face config dict (defaults filled in) of a config dict read from a GGUF file."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**cfg).to_dict()


def build_cut_draft(model: str, n_layers: int, d2t: torch.Tensor, eos_target: int):
    """A Hugging Face model of the target's own family over len(d2t) rows made of the target's first n_layers
    layers, its final norm and its embedding rows d2t (row 0, "other", = the mean row), tied as input embedding
    and LM head. A llama target is read tensor by tensor (only the layers kept are dequantized); any other family
    leaplm runs natively (Gemma 3, Qwen) through transformers' own GGUF or checkpoint reader."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models.arch import arch_of

    tcfg, sd = _cut_source(model, n_layers)
    mt = tcfg.get("model_type", "llama")
    if arch_of(mt) is None:
        raise ConfigError("shape", f"{CUT_PREFIX}N needs a target leaplm runs natively, got model_type {mt!r}")
    total = int(tcfg["num_hidden_layers"])
    if n_layers >= total:
        raise ConfigError("shape", f"{CUT_PREFIX}{n_layers}: the target has only {total} layers")
    t2d_eos = int((d2t == eos_target).nonzero()[0]) if bool((d2t == eos_target).any()) else 0
    own_cfg = {k: v for k, v in tcfg.items() if k not in _NOT_CONFIG}
    own_cfg |= dict(vocab_size=len(d2t), tie_word_embeddings=True, num_hidden_layers=n_layers,
                    bos_token_id=t2d_eos, eos_token_id=t2d_eos, pad_token_id=0)
    if isinstance(tcfg.get("layer_types"), list):             # per-layer attention kinds (Gemma 3, Qwen)
        own_cfg["layer_types"] = tcfg["layer_types"][:n_layers]
    draft = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **own_cfg))
    emb = sd["model.embed_tokens.weight"]                               # [V, H]
    rows = emb[d2t.clamp(min=0)].clone()                                # [N, H]
    rows[0] = emb.mean(0)
    own = {"model.embed_tokens.weight": rows, "model.norm.weight": sd["model.norm.weight"]}
    own |= {k: v for k, v in sd.items() if k.startswith("model.layers.") and int(k.split(".")[2]) < n_layers}
    missing, unexpected = draft.load_state_dict(own, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" and "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"shape: cannot cut the target: missing {missing[:3]}, unexpected {unexpected[:3]}")
    draft.tie_weights()
    return draft


# config keys of the target that do not describe the cut model's architecture
_NOT_CONFIG = ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
               "id2label", "label2id", "layer_types", "quantization_config")


def _cut_source(model: str, n_layers: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, fp32 state dict with Hugging Face names) of the target the cut is taken from."""
    from ..models.gguf import inspect_gguf, is_gguf, read_gguf_checkpoint

    if is_gguf(model):
        info = inspect_gguf(model, "target")
        if info.architecture != "llama":
            cfg, sd = read_gguf_checkpoint(info, torch.float32, "target")
            return cfg, {k if k.startswith(("model.", "lm_head")) else f"model.{k}": v for k, v in sd.items()}
    return target_checkpoint(model, n_layers)


def build_draft(shape_name: str, model: str, seed: int, d2t: torch.Tensor, target_emb: torch.Tensor | None,
                eos_target: int):
    """A fresh HF llama over len(d2t) rows, embedding = PCA projection of the target's rows (scaled to the
    usual init std); a "cut-N" shape starts from the target's own first N layers instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if (n := cut_layers(shape_name)) is not None:
        return build_cut_draft(model, n, d2t, eos_target)
    shape = DRAFT_SHAPES[shape_name]
    t2d_eos = int((d2t == eos_target).nonzero()[0]) if bool((d2t == eos_target).any()) else 0
    conf = LlamaConfig(vocab_size=len(d2t), tie_word_embeddings=True, max_position_embeddings=8192,
                       rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=t2d_eos, eos_token_id=t2d_eos, **shape)
    draft = LlamaForCausalLM(conf)
    h = shape["hidden_size"]
    rows = target_emb[d2t.clamp(min=0)]                               # [N, H_target]
    rows[0] = target_emb.mean(0)
    centered = rows - rows.mean(0)
    _, _, v = torch.pca_lowrank(centered, q=min(h, centered.shape[1]), center=False)
    proj = centered @ v                                                # [N, <= h]
    emb = torch.zeros(len(d2t), h)
    emb[:, : proj.shape[1]] = proj / proj.std() * conf.initializer_range
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(emb)
    return draft

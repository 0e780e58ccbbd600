"""EAGLE head layouts other than leaplm's own (heads/checkpoint.py), to export and import.

Speculators (what `speculators` and vLLM's `--speculative-config '{"model": DIR, "method": "eagle"}'` load):
config.json with speculators_model_type "eagle", architectures ["EagleSpeculator"], the draft layer's
LlamaConfig as transformer_layer_config (one layer), layernorms false (no input norm, as EAGLE-1), fusion_bias,
and speculators_config {algorithm, proposal_methods [{proposal_type, speculative_tokens}], default_proposal_method,
verifier {name_or_path, architectures}}; model.safetensors with fc.weight, layers.0.self_attn.{q,k,v,o}_proj,
layers.0.mlp.{gate,up,down}_proj, layers.0.post_attention_layernorm, embed_tokens and lm_head (the target's).
Older Speculators files name fc "fusion_fc" and the layer "transformer."; both are read.

EAGLE's original repositories: a Llama config.json for the one-layer draft (num_hidden_layers 1) and
pytorch_model.bin (or model.safetensors) with fc.weight (+ fc.bias), layers.0.* and optionally embed_tokens.

A head with a reduced draft vocabulary (heads/vocab.py) is written as EAGLE-3 files are: its own lm_head.weight
[N, hid], d2t [N] int64 offsets and t2d [V] bool beside the layer, and draft_vocab_size in the config (top level
and in transformer_layer_config). vLLM reads d2t in its EAGLE-3 models only; its EAGLE-1 path loads heads over the
whole vocabulary, so export those (no --draft-vocab) for `"method": "eagle"`.

Neither records the target's weights' hash, so leaplm writes its own identity under "leaplm_target" in
config.json (other readers ignore unknown keys); on import without it, hidden size and vocabulary are checked,
and the embedding (when the file carries one) must equal the target's.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from ..config import ConfigError
from .checkpoint import FORMAT, HeadFile, TargetIdentity, identity_of, read_head

# leaplm EagleNet parameter -> the name inside layers.0 (Hugging Face's LlamaDecoderLayer)
_LAYER = {"q_proj.weight": "self_attn.q_proj.weight", "k_proj.weight": "self_attn.k_proj.weight",
          "v_proj.weight": "self_attn.v_proj.weight", "o_proj.weight": "self_attn.o_proj.weight",
          "gate_proj.weight": "mlp.gate_proj.weight", "up_proj.weight": "mlp.up_proj.weight",
          "down_proj.weight": "mlp.down_proj.weight",
          "post_attention_layernorm.weight": "post_attention_layernorm.weight"}


def _layer_config(head: dict) -> dict:
    """The one-layer LlamaConfig of the draft, as transformers writes it."""
    extra = {"draft_vocab_size": head["draft_vocab_size"]} if head.get("draft_vocab_size") else {}
    return extra | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": head["hidden_size"],
            "intermediate_size": head["intermediate_size"], "num_attention_heads": head["num_attention_heads"],
            "num_key_value_heads": head["num_key_value_heads"], "head_dim": head["head_dim"],
            "num_hidden_layers": 1, "vocab_size": head["vocab_size"], "rms_norm_eps": head["rms_norm_eps"],
            "rope_theta": head["rope_theta"], "max_position_embeddings": head["max_position_embeddings"],
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32"}


_OWN = ("d2t", "t2d", "lm_head.weight")            # a reduced-vocabulary head's own tensors, same names everywhere


def _to_layout(hf: HeadFile, target) -> dict[str, torch.Tensor]:
    out = {(k if k.startswith("fc.") or k in _OWN else f"layers.0.{_LAYER[k]}"): v for k, v in hf.state.items()}
    m = target.model
    out["embed_tokens.weight"] = m.embed_tokens.weight.detach().float().contiguous()
    if "lm_head.weight" not in out:                  # a full-vocabulary head drafts through the target's
        out["lm_head.weight"] = m.lm_head.weight.detach().float().contiguous()
    return out


def export_head(head_dir: str | Path, out_dir: str | Path, target, layout: str = "speculators",
                speculative_tokens: int = 5) -> Path:
    """Write the leaplm EAGLE head at head_dir in `layout` ('speculators' or 'eagle') to out_dir."""
    from safetensors.torch import save_file

    hf = read_head(head_dir)
    if hf.kind != "eagle":
        raise ConfigError("head", f"{head_dir} holds a {hf.kind} head; only EAGLE heads export")
    if layout not in ("speculators", "eagle"):
        raise ConfigError("layout", f"must be 'speculators' or 'eagle', got {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = _to_layout(hf, target)
    ident = asdict(hf.target)
    if layout == "speculators":
        cfg = {"architectures": ["EagleSpeculator"], "speculators_model_type": "eagle",
               "transformer_layer_architecture": "LlamaDecoderLayer",
               "transformer_layer_config": _layer_config(hf.config), "layernorms": False,
               "fusion_bias": bool(hf.config.get("fusion_bias", False)),
               **({"draft_vocab_size": hf.config["draft_vocab_size"]} if hf.config.get("draft_vocab_size") else {}),
               "speculators_config": {
                   "algorithm": "eagle", "default_proposal_method": "greedy",
                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                   "verifier": {"name_or_path": str(target.name),
                                "architectures": list(target.config.get("architectures") or [])}},
               "leaplm_target": ident}
        save_file(weights, str(out / "model.safetensors"))
    else:
        cfg = {**_layer_config(hf.config), "bias": bool(hf.config.get("fusion_bias", False)),
               "leaplm_target": ident}
        own_head = hf.config.get("draft_vocab_size") is not None     # the target's lm_head is not the head's
        torch.save({k: v for k, v in weights.items() if k != "lm_head.weight" or own_head}, out / "pytorch_model.bin")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def read_any(d: Path, target) -> HeadFile:
    """A HeadFile from any supported layout (leaplm, Speculators, EAGLE), checked structurally."""
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise ConfigError("head", f"{d} has no config.json")
    try:
        meta = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("head", f"{cfg_path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if meta.get("format") == FORMAT:
        return read_head(d)
    if meta.get("speculators_model_type") is not None:
        if meta["speculators_model_type"] != "eagle":
            raise ConfigError("head", f"{d}: speculators_model_type {meta['speculators_model_type']!r} is not "
                                      f"supported (only 'eagle')")
        if meta.get("layernorms"):
            raise ConfigError("head", f"{d}: layernorms=true (the HASS/TTT variant) is not supported")
        layer = meta.get("transformer_layer_config") or {}
        return _imported(d, meta, layer, bool(meta.get("fusion_bias", False)), target)
    if meta.get("num_hidden_layers") == 1 and "hidden_size" in meta:
        return _imported(d, meta, meta, bool(meta.get("bias", True)), target)
    raise ConfigError("head", f"{d}: unknown head layout (config.json is neither leaplm's, Speculators' nor "
                              f"EAGLE's)")


def _load_weights(d: Path) -> dict[str, torch.Tensor]:
    st, pt = d / "model.safetensors", d / "pytorch_model.bin"
    try:
        if st.exists():
            from safetensors.torch import load_file

            return load_file(str(st))
        if pt.exists():
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - damaged files raise many types
        raise ConfigError("head", f"{d}: weights are corrupt or truncated ({type(e).__name__}: {e})") from None
    raise ConfigError("head", f"{d} has neither model.safetensors nor pytorch_model.bin")


def _imported(d: Path, meta: dict, layer: dict, fusion_bias: bool, target) -> HeadFile:
    w = _load_weights(d)
    state: dict[str, torch.Tensor] = {}
    back = {v: k for k, v in _LAYER.items()}
    draft = "d2t" in w                                 # a reduced draft vocabulary: its lm_head is the head's own
    for name, t in w.items():
        n = name.replace("fusion_fc.", "fc.").replace("transformer.", "layers.0.")
        if n.startswith("fc.") or (draft and n in _OWN):
            state[n] = t
        elif n.startswith("layers.0."):
            rest = n[len("layers.0."):]
            if rest == "input_layernorm.weight":
                continue                                    # EAGLE-1 drops the first layer's input norm
            if rest not in back:
                raise ConfigError("head", f"{d}: unexpected weight {name!r}")
            state[back[rest]] = t
    have = identity_of(target)
    try:
        head = {"hidden_size": layer["hidden_size"], "intermediate_size": layer["intermediate_size"],
                "num_attention_heads": layer["num_attention_heads"],
                "num_key_value_heads": layer.get("num_key_value_heads") or layer["num_attention_heads"],
                "head_dim": layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
                "vocab_size": layer["vocab_size"], "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
                "rope_theta": layer.get("rope_theta", 10000.0),
                "max_position_embeddings": layer.get("max_position_embeddings", 2048), "fusion_bias": fusion_bias}
    except KeyError as e:
        raise ConfigError("head", f"{d}/config.json lacks {e.args[0]!r}") from None
    if draft:
        from .vocab import ids_of, maps_of

        if "lm_head.weight" not in state:
            raise ConfigError("head", f"{d}: d2t without the head's own lm_head.weight")
        ids = ids_of(state["d2t"], state.get("t2d"), head["vocab_size"], str(d))
        state["d2t"], state["t2d"] = maps_of(ids, head["vocab_size"])     # t2d is optional in some files
        head["draft_vocab_size"] = int(ids.numel())
    if "leaplm_target" in meta:
        ident = TargetIdentity(**meta["leaplm_target"])
    else:                                   # only what the file can tell: shapes, and the embedding if present
        ident = TargetIdentity(head["hidden_size"], head["vocab_size"], have.num_hidden_layers, have.weights_sha256)
        emb = w.get("embed_tokens.weight")
        if emb is not None and (emb.shape != target.model.embed_tokens.weight.shape or not torch.equal(
                emb.float(), target.model.embed_tokens.weight.detach().float())):
            raise ConfigError("head", f"{d} was trained for another target: embed_tokens differ from the target's")
    return HeadFile("eagle", head, ident, state, meta)

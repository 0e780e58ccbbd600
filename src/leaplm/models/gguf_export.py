"""Write a Hugging Face Llama or Gemma 3 checkpoint (leaplm's embedded models included) as a GGUF file llama.cpp runs.

The layout is what llama.cpp's own converter writes for a Llama: its tensor names, q/k rows permuted from
Hugging Face's rotate-half order into llama.cpp's interleaved pairs, 1-D tensors in F32, the tokenizer as
tokenizer.ggml.* metadata. Matrices are written as F32, F16 or Q8_0 (gguf.quants, the reference quantizer).

A reduced-vocabulary draft (models/draft_vocab.py) is expanded to the target's V rows, since llama.cpp has no
vocabulary mapping for drafts and checks that draft and target vocabularies agree:
- token_embd: row t = the draft's row t2d[t] (its "other" row 0 for tokens outside the draft vocabulary),
  so the draft reads every input exactly as leaplm's mapping does;
- output: row d2t[i] = the draft's LM-head row i; all other rows are zero, so those tokens get logit 0 where
  leaplm gives -inf. A linear head without bias cannot express -inf: the exported draft proposes one of them
  only when every in-vocabulary logit is below 0 (rare; the target verifies every proposal anyway).
The expanded LM head is V x hidden: for SmolLM2 (V = 49152) it dominates the draft's bytes per token.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError

log = logging.getLogger(__name__)

TENSOR_TYPES = ("f32", "f16", "q8_0")
_TOKENIZER_PRE = "gpt-2"          # llama.cpp's name for GPT-2's byte-level pre-tokenizer regex


@dataclass
class ExportResult:
    path: Path
    tensor_type: str
    vocab_size: int                 # rows of token_embd / output in the file
    draft_vocab_rows: int | None    # the source's reduced vocabulary, when it was expanded to vocab_size
    tokenizer_source: str           # "tokenizer.json" or the GGUF file the tokenizer fields were copied from
    bytes: int
    f16_fallback: list[str]         # q8_0 asked, but rows not a multiple of 32: these matrices are F16


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """[rows, cols] Hugging Face rotate-half rows -> llama.cpp's interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


EXPORTED = ("llama", "gemma3_text")      # model types written (models/arch names their tensors)


def _check_config(cfg: dict, src: str) -> None:
    """Refuse, naming the config field, what this writer does not express (llama.cpp would run it wrongly)."""
    mt = cfg.get("model_type")
    if mt not in EXPORTED:
        raise ConfigError("source", f"{src}: model_type {mt!r}; the GGUF export writes {', '.join(EXPORTED)} "
                                    "checkpoints only")
    if mt == "gemma3_text":
        _check_gemma3(cfg, src)
        return
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError("source", f"{src}: rope_type {rope.get('rope_type')!r} is not exported (default only)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ConfigError("source", f"{src}: {key} is true; llama.cpp's llama graph has no such biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError("source", f"{src}: hidden_act {cfg['hidden_act']!r}; llama.cpp's llama uses silu")


def _check_gemma3(cfg: dict, src: str) -> None:
    """llama.cpp's gemma3 stores no local RoPE base, window pattern or attention scale: it assumes them
    (arch.gemma3.GEMMA3.gguf_implied); a checkpoint that differs would run wrongly."""
    from transformers import AutoConfig

    from .arch import GEMMA3

    c = AutoConfig.for_model(**cfg)
    n = c.num_hidden_layers
    pattern = ["sliding_attention" if (i + 1) % GEMMA3.gguf_implied["sliding_window_pattern"] else "full_attention"
               for i in range(n)]
    if list(c.layer_types) != pattern:
        raise ConfigError("source", f"{src}: layer_types {c.layer_types}; llama.cpp's gemma3 makes every sixth "
                                    "layer global")
    local = c.rope_parameters["sliding_attention"]
    if local.get("rope_theta") != GEMMA3.gguf_implied["rope_local_base_freq"] or local.get("rope_type") != "default":
        raise ConfigError("source", f"{src}: sliding layers' rope {local}; llama.cpp's gemma3 uses base 10000")
    if c.query_pre_attn_scalar != c.head_dim:
        raise ConfigError("source", f"{src}: query_pre_attn_scalar {c.query_pre_attn_scalar}; llama.cpp's gemma3 "
                                    f"scales attention by head_dim ({c.head_dim}) ** -0.5")
    full = c.rope_parameters["full_attention"]
    if full.get("rope_type", "default") != "default":
        raise ConfigError("source", f"{src}: rope_type {full.get('rope_type')!r} is not exported (default only)")
    for key in ("attention_bias",):
        if getattr(c, key, False):
            raise ConfigError("source", f"{src}: {key} is true; llama.cpp's gemma3 graph has no such biases")


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in path.glob("*.safetensors") if f.name != "draft_vocab.safetensors")
    if not files:
        raise ConfigError("source", f"{path}: no *.safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update({k.removeprefix("model."): v.float() for k, v in load_file(str(f)).items()})
    return sd


def _expand_draft_vocab(embed: torch.Tensor, head: torch.Tensor, d2t: torch.Tensor, vocab: int):
    """(token_embd [V, d], output [V, d]) of a reduced-vocabulary draft over the target's V tokens."""
    from .draft_vocab import t2d_table

    keep = d2t >= 0                                                   # [N]; row 0 is "any other token"
    full_embed = embed[t2d_table(d2t, vocab)]                         # [V, d]
    full_head = head.new_zeros(vocab, head.shape[1])                  # [V, d]: logit 0 outside the vocabulary
    full_head[d2t[keep]] = head[keep]
    return full_embed, full_head


def _tokenizer_fields_from_hf(writer, src: Path, vocab: int, cfg: dict) -> None:
    """tokenizer.ggml.* of a byte-level BPE tokenizer.json (GPT-2 style), as llama.cpp's converter writes it."""
    import gguf
    from transformers import AutoTokenizer

    from .tokens import bos_to_add

    tok = AutoTokenizer.from_pretrained(str(src))
    tj = json.loads(tok.backend_tokenizer.to_str())
    pre = tj.get("pre_tokenizer") or {}
    if tj["model"]["type"] != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ConfigError("tokenizer_from", f"{src}: the tokenizer is not a GPT-2 style byte-level BPE "
                                            f"(model {tj['model']['type']}, pre-tokenizer {pre.get('type')}); "
                                            "pass --tokenizer-from a GGUF file with the same tokenizer")
    id2tok = {i: t for t, i in tok.get_vocab().items()}
    special = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    added = {t.content for t in tok.added_tokens_decoder.values()}
    tokens, types = [], []
    for i in range(vocab):
        t = id2tok.get(i)
        if t is None:                                  # ids the model has but the tokenizer never emits
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(t)
            types.append(gguf.TokenType.CONTROL if t in special else
                         gguf.TokenType.USER_DEFINED if t in added else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_TOKENIZER_PRE)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    eos = tok.eos_token_id if tok.eos_token_id is not None else cfg.get("eos_token_id")
    bos = tok.bos_token_id if tok.bos_token_id is not None else cfg.get("bos_token_id", eos)
    if isinstance(eos, list):
        eos = eos[0]
    if eos is not None:
        writer.add_eos_token_id(int(eos))
    if bos is not None:
        writer.add_bos_token_id(int(bos))
    writer.add_add_bos_token(bos_to_add(tok) is not None)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def _tokenizer_fields_from_gguf(writer, gguf_path: str, vocab: int) -> None:
    """Copy every tokenizer.* field of another GGUF file (the target's, for a draft: identical vocabularies)."""
    from gguf import GGUFReader, GGUFValueType

    p = Path(gguf_path).expanduser()
    if not p.is_file():
        raise ConfigError("tokenizer_from", f"{gguf_path!r} is not a file")
    reader = GGUFReader(str(p))
    n = len(reader.fields["tokenizer.ggml.tokens"].contents()) if "tokenizer.ggml.tokens" in reader.fields else 0
    if n != vocab:
        raise ConfigError("tokenizer_from", f"{gguf_path}: {n} tokens, the exported model has {vocab} rows")
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            vt = f.types[0]
            writer.add_key_value(key, f.contents(), vt, sub_type=f.types[1] if vt == GGUFValueType.ARRAY else None)


def export_gguf(source: str, out: str, tensor_type: str = "f32", tokenizer_from: str | None = None) -> ExportResult:
    """Write the Llama checkpoint directory `source` to the GGUF file `out` (see the module docstring)."""
    import gguf
    from gguf.quants import quantize

    from .draft_vocab import has_draft_vocab, read_d2t

    if tensor_type not in TENSOR_TYPES:
        raise ConfigError("type", f"one of {', '.join(TENSOR_TYPES)}, got {tensor_type!r}")
    src = Path(source).expanduser()
    if not (src / "config.json").is_file():
        raise ConfigError("source", f"{source!r} is not a checkpoint directory (no config.json)")
    cfg = json.loads((src / "config.json").read_text())
    _check_config(cfg, source)
    sd = _state_dict(src)
    H, Hkv, L = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"], \
        cfg["num_hidden_layers"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // H
    embed = sd["embed_tokens.weight"]                                   # [N, d]
    head = sd.get("lm_head.weight", embed)                              # [N, d]; tied when absent
    tied = "lm_head.weight" not in sd or cfg.get("tie_word_embeddings", False)
    draft_rows = None
    vocab = cfg["vocab_size"]
    if has_draft_vocab(src):
        draft_rows, vocab = vocab, cfg["leaplm_draft"]["target_vocab_size"]
        embed, head = _expand_draft_vocab(embed, head, read_d2t(src), vocab)
        tied = False                                                    # the expanded head differs from embed
    from .arch import arch_of

    arch = arch_of(cfg["model_type"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)                             # per layer type (gemma3)
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    arch_name = arch.gguf_architectures[0]

    out_path = Path(out).expanduser()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out_path), arch_name)
    w.add_name(src.name)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[tensor_type])
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    if arch.window == "layer_types":
        w.add_sliding_window(int(cfg["sliding_window"]))
    w.add_vocab_size(vocab)
    if tokenizer_from:
        _tokenizer_fields_from_gguf(w, tokenizer_from, vocab)
    else:
        _tokenizer_fields_from_hf(w, src, vocab, cfg)

    f16_fallback: list[str] = []

    def put(name: str, t: torch.Tensor) -> None:
        a = np.ascontiguousarray(t.float().numpy())
        if a.ndim == 1 or tensor_type == "f32":
            w.add_tensor(name, a)
        elif tensor_type == "f16" or a.shape[-1] % 32:      # Q8_0 blocks are 32 along a row: F16 otherwise,
            if tensor_type != "f16":                          # as llama.cpp's converter falls back
                f16_fallback.append(name)
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quantize(a, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    # llama.cpp's converter stores the norms' offset with the weight (Gemma: 1 + w) and q/k rows as interleaved
    # pairs for the families whose files are read that way
    norm = (lambda t: t + arch.norm_offset) if arch.norm_offset else (lambda t: t)
    put("token_embd.weight", embed)
    put("output_norm.weight", norm(sd["norm.weight"]))
    if not tied:
        put("output.weight", head)
    hn, gn = arch.hf_layer, arch.gguf_layer
    for i in range(L):
        p, b = f"layers.{i}.", f"blk.{i}."
        permute = llama_cpp_permute if arch.gguf_paired_rope else (lambda t, n: t)
        put(b + gn.q + ".weight", permute(sd[p + hn.q + ".weight"], H))
        put(b + gn.k + ".weight", permute(sd[p + hn.k + ".weight"], Hkv))
        for name in ("v", "o", "gate", "up", "down"):
            put(b + getattr(gn, name) + ".weight", sd[p + getattr(hn, name) + ".weight"])
        for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm"):
            if getattr(hn, name) is not None:
                put(b + getattr(gn, name) + ".weight", norm(sd[p + getattr(hn, name) + ".weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if f16_fallback:
        log.warning("%s: %d matrices have rows that are not a multiple of Q8_0's block of 32 (hidden size %d): "
                    "written as F16", out_path.name, len(f16_fallback), hidden)
    return ExportResult(out_path, tensor_type, vocab, draft_rows, tokenizer_from or "tokenizer.json",
                        out_path.stat().st_size, f16_fallback)

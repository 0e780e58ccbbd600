"""A GGUF file's Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K / Q6_K blocks straight into leaplm's int8 kernel (`--quantization gguf`, the default
for such files): no full-precision copy of any matrix is made.

Each decoder matrix and the output projection is read as the file stores it (a view of the mapped file) and moved
into the kernel's layout (quant/linear.pack_gguf in one copy; pack_gguf_chunked a chunk of rows at a time for the
other types, so a K-quant's wider temporaries are a chunk's; without the extension, quant/formats.from_gguf_blocks
for the PyTorch path); only that packed form is kept, and the file's pages are dropped from the process's resident
memory once packed. Norms and biases are the file's own F32 vectors. The token embedding is not copied at all: it
stays in the mapped file (FileRows) and a forward converts the T rows it looks up (exactly the values a
dequantized copy would hold: a block's integer times its fp16 scale, plus its fp16 minimum, rounds once in fp32
either way). So the process holds the packed matrices, the file's pages of the rows it has looked up, the KV
cache and the runtime: no second copy of any matrix.

Row order: llama.cpp's converter stores llama/mistral q and k rows with each rotated pair interleaved, which is
the native model's own layout (llama.interleave_rope_rows), so those rows are taken as they are; qwen2/qwen3 files
keep Hugging Face's rotate-half order (llama.cpp runs them with NEOX rope) and their rows are reordered here, an
exact permutation of whole rows.
"""
from __future__ import annotations

import logging
import mmap

import numpy as np
import torch
from torch import nn

from ..quant.formats import GGUF_TYPES, from_gguf_blocks
from . import packed_cache
from .arch import BY_GGUF_ARCHITECTURE
from .base import LoadedModel
from .gguf import GGUFFile, GGUFInfo, dequantize_tensor, parse_gguf, read_gguf_config
from .llama import meta_model
from .native_config import args_from_hf_config, native_blockers

log = logging.getLogger(__name__)

KERNEL_TYPES = tuple(GGUF_TYPES)              # the block types the int8 kernel computes on as stored


def kernel_blockers(g: GGUFFile, cfg: dict) -> list[str]:
    """Why this file cannot load straight into the kernel (empty: it can): a matrix of another type, a missing
    tensor, or a config field the native model does not implement."""
    out = list(native_blockers(cfg))
    n = cfg["num_hidden_layers"]
    need = [f"blk.{i}.{m}.weight" for i in range(n)
            for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    need.append("output.weight" if "output.weight" in g.tensors else "token_embd.weight")
    for name in need:
        t = g.tensors.get(name)
        if t is None:
            out.append(f"tensor {name} is missing")
        elif t.type_name not in KERNEL_TYPES:
            out.append(f"tensor {name} is {t.type_name} (the kernel takes {', '.join(KERNEL_TYPES)})")
        if out:
            break
    if "token_embd.weight" not in g.tensors:
        out.append("tensor token_embd.weight is missing")
    return out


def _drop_pages(g: GGUFFile, start: int, end: int) -> None:
    """Drop the whole pages of the file's bytes [start, end) from the process's resident memory (a read-only
    mapping: they stay in the page cache and come back on the next read)."""
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if g.data is None or hi <= lo or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        g.data.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):
        pass


def _vector(g: GGUFFile, name: str) -> torch.Tensor:
    """A 1-D tensor (norm weight, bias) as fp32, copied out of the mapping (they are small)."""
    t = g.tensors[name]
    if t.type_name in ("F32", "F16"):
        return torch.from_numpy(np.array(g.raw(name), dtype=np.float32)).reshape(t.shape)
    return dequantize_tensor(g, name)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class FileRows:
    """A token embedding [N, K] read where it lies: the file's blocks in the memory map, of which a forward converts
    the rows it looks up (a few KB a token). Held converted, Gemma 3 270M's 262,144 x 640 Q8_0 embedding would take
    190 MB beside the head the kernel packs from the same tensor; this way it takes the pages its tokens touch."""

    def __init__(self, raw, type_name: str, shape: tuple[int, int]):
        self.raw = raw                       # uint8 [N, bytes per row], a view of the mapping (no copy)
        self.type_name = type_name
        self.shape = shape

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def rows(self, index: torch.Tensor):
        """The QuantizedWeight [M, K] of the rows at index (flattened)."""
        idx = index.reshape(-1).numpy()
        return from_gguf_blocks(self.raw[idx], self.type_name, (len(idx), self.shape[1]))

    def whole(self):
        """Every row as a QuantizedWeight (for what reads the whole embedding: a head trained on it, an export)."""
        return from_gguf_blocks(self.raw, self.type_name, self.shape)


def load_gguf_kernel(info: GGUFInfo, name: str, field: str = "model",
                     cache_dtype: torch.dtype = torch.float32) -> LoadedModel | None:
    """The file on the int8 kernel from its own blocks, or None (logged) when kernel_blockers says it cannot."""
    from ..kernels.build import load as load_kernel
    from ..quant.linear import QuantizedLinear, SplitLinear, fused_linear, pack_gguf, pack_gguf_chunked
    from .gguf import load_gguf_tokenizer
    from .llama import interleave_rope_rows
    from .tokens import prompt_bos

    g = parse_gguf(info.path, field)
    cfg = read_gguf_config(info, field)
    why = kernel_blockers(g, cfg)
    if why:
        log.info("%s: loaded dequantized, not from its blocks (%s)", info.path, why[0])
        return None
    a = args_from_hf_config(cfg)
    H, Hkv, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    arch = BY_GGUF_ARCHITECTURE[info.architecture]
    reorder = not arch.gguf_paired_rope        # q/k rows in Hugging Face's rotate-half order (NEOX rope)

    def perm(n_heads: int) -> torch.Tensor:
        return interleave_rope_rows(torch.arange(n_heads * D), n_heads, D)

    def blocks(name: str, rows: torch.Tensor | None = None):
        t = g.tensors[name]
        K, N = t.dims[0], t.n_elements // t.dims[0]
        qw = from_gguf_blocks(g.raw(name), t.type_name, (N, K))
        g.release(name)
        return qw if rows is None else qw.rows(rows)

    ext = load_kernel()

    def dropped(names: list[str]):
        """The packers' done(i, r0, r1): rows [r0, r1) of names[i] are packed; their pages leave the resident set
        (the output layer of a 1B model is ~150 MB of the file, which need not be resident while it is packed)."""
        def done(i: int, r0: int, r1: int) -> None:
            t = g.tensors[names[i]]
            per_row = t.n_bytes // (t.n_elements // t.dims[0])
            _drop_pages(g, t.offset + r0 * per_row, t.offset + r1 * per_row)
        return done

    cached = packed_cache.load(info.path) if ext is not None else None

    def linear(key: str, names: list[str], rows: list | None = None) -> QuantizedLinear | SplitLinear:
        """The linear `key` over these tensors' rows stacked (fused q/k/v, gate/up; formats that mix make a split
        linear). On the extension, the blocks go from the file straight into its layout (quant/linear.pack_gguf, or
        pack_gguf_chunked a chunk of rows at a time) and nothing but the packed form is kept, or they come mapped
        from the packed-weight cache (models/packed_cache.py)."""
        if cached is not None and key in cached:
            parts = [QuantizedLinear.from_packed(p) for p in cached[key]]
            return parts[0] if len(parts) == 1 else SplitLinear(parts)
        rows = rows or [None] * len(names)
        types = [g.tensors[n].type_name for n in names]
        if ext is None:                      # the PyTorch path computes on QuantizedWeights
            return fused_linear([blocks(n, r) for n, r in zip(names, rows)])
        packed = pack_gguf([g.raw(n) for n in names], types[0], rows, dropped(names)) \
            if len(set(types)) == 1 else None
        if packed is not None:
            for n in names:
                g.release(n)
            return QuantizedLinear.from_packed(packed)
        runs: list[list[int]] = []           # parts of one kernel format (Q4_K q, k beside a Q6_K v: two runs)
        for j, t in enumerate(types):
            if runs and GGUF_TYPES[types[runs[-1][0]]] == GGUF_TYPES[t]:
                runs[-1].append(j)
            else:
                runs.append([j])
        lins = []
        for run in runs:
            K = g.tensors[names[run[0]]].dims[0]
            pk = pack_gguf_chunked([(g.raw(names[j]), types[j], rows[j]) for j in run], K,
                                   dropped([names[j] for j in run]))
            lins.append(QuantizedLinear.from_packed(pk) if pk is not None else
                        fused_linear([blocks(names[j], rows[j]) for j in run]))
            for j in run:
                g.release(names[j])
        return lins[0] if len(lins) == 1 else SplitLinear(lins)

    model = meta_model(a)
    empty = lambda: _param(torch.empty(0, dtype=torch.float32))   # noqa: E731  (a weight the kernel holds)
    q = model.quantized
    nm = arch.gguf_layer             # norm weights as stored: llama.cpp's converter already added norm_offset
    for i, blk in enumerate(model.layers):
        b = f"blk.{i}."
        blk.input_layernorm.weight = _param(_vector(g, f"{b}{nm.attn_norm}.weight"))
        blk.post_attention_layernorm.weight = _param(_vector(g, f"{b}{nm.mlp_norm}.weight"))
        at = blk.self_attn
        q[f"layers.{i}.self_attn.qkv.weight"] = linear(f"layers.{i}.self_attn.qkv.weight",
                                                       [f"{b}{nm.q}.weight", f"{b}{nm.k}.weight", f"{b}{nm.v}.weight"],
                                                       [perm(H), perm(Hkv), None] if reorder else None)
        q[f"layers.{i}.self_attn.o_proj.weight"] = linear(f"layers.{i}.self_attn.o_proj.weight", [f"{b}{nm.o}.weight"])
        q[f"layers.{i}.mlp.gate_up.weight"] = linear(f"layers.{i}.mlp.gate_up.weight",
                                                     [f"{b}{nm.gate}.weight", f"{b}{nm.up}.weight"])
        q[f"layers.{i}.mlp.down_proj.weight"] = linear(f"layers.{i}.mlp.down_proj.weight", [f"{b}{nm.down}.weight"])
        for mod in (at.qkv, at.o_proj, blk.mlp.gate_up, blk.mlp.down_proj):
            mod.weight = empty()
        if a.attention_bias:
            qb, kb, vb = (_vector(g, f"{b}{n}.bias") for n in (nm.q, nm.k, nm.v))
            if reorder:
                qb, kb = interleave_rope_rows(qb, H, D), interleave_rope_rows(kb, Hkv, D)
            at.qkv.bias = _param(torch.cat([qb, kb, vb]))
        if a.o_bias:
            at.o_proj.bias = _param(_vector(g, f"{b}{nm.o}.bias"))
        if a.mlp_bias:
            blk.mlp.gate_up.bias = _param(torch.cat([_vector(g, f"{b}{nm.gate}.bias"), _vector(g, f"{b}{nm.up}.bias")]))
            blk.mlp.down_proj.bias = _param(_vector(g, f"{b}{nm.down}.bias"))
        if a.qk_norm:
            qn, kn = _vector(g, f"{b}{nm.q_norm}.weight"), _vector(g, f"{b}{nm.k_norm}.weight")
            at.q_norm.weight = _param(interleave_rope_rows(qn, 1, D) if reorder else qn)
            at.k_norm.weight = _param(interleave_rope_rows(kn, 1, D) if reorder else kn)
        if a.post_norms:
            at.post_norm.weight = _param(_vector(g, f"{b}{nm.post_attn_norm}.weight"))
            blk.mlp.post_norm.weight = _param(_vector(g, f"{b}{nm.post_mlp_norm}.weight"))
    model.norm.weight = _param(_vector(g, "output_norm.weight"))
    head_name = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    et = g.tensors["token_embd.weight"]
    if et.type_name in KERNEL_TYPES:                 # looked up row by row from its blocks (LlamaForCausalLM.embed)
        model.embed_quantized = FileRows(g.raw("token_embd.weight"), et.type_name,
                                         (et.n_elements // et.dims[0], et.dims[0]))
        model.embed_tokens.weight = empty()
    else:
        model.embed_tokens.weight = _param(dequantize_tensor(g, "token_embd.weight"))
    q["lm_head.weight"] = linear("lm_head.weight", [head_name])
    if ext is not None and cached is None:
        packed_cache.save(info.path, q)
    model.lm_head.weight = model.embed_tokens.weight if a.tie_word_embeddings else empty()
    model.reset_buffers("cpu")
    model._fast = None
    model.cache_dtype = cache_dtype
    model.eval()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        return _refuse(info, f"no tensor in the file for {left[0]}")
    tok = load_gguf_tokenizer(info, field)
    eos = cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids and tok.eos_token_id is not None:
        eos_ids = [tok.eos_token_id]
    n_params = sum(t.n_elements for t in g.tensors.values() if t.name != "rope_freqs.weight")
    log.info("loaded %s (GGUF %s, %.1fM parameters, %s blocks as stored on the int8 kernel)", info.path,
             info.architecture, n_params / 1e6, "/".join(sorted({t.type_name for t in g.tensors.values()
                                                                  if t.type_name in KERNEL_TYPES})))
    return LoadedModel(model, tok, str(info.path), name, cfg, eos_ids, n_params, prompt_bos(tok, cfg.get("model_type"), cfg.get("bos_token_id")))


def _refuse(info: GGUFInfo, why: str) -> None:
    log.info("%s: loaded dequantized, not from its blocks (%s)", info.path, why)
    return None

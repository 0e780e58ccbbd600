"""Random-weight GGUF files of a published model's shape (models/synth_shapes.py), for benchmarks only.

A forward's cost depends on the shapes and the block types, not on the values, so a file of random blocks times
like the real model. The blocks are written directly: random quants and one fp16 scale per tensor (chosen so the
dequantized weights have standard deviation `std`), streamed a chunk of rows at a time; memory is bounded by the
chunk, never by a tensor or the model, and no full-precision copy of anything but the 1-D tensors exists.

Formats (general.file_type as llama.cpp numbers them):
  Q4_0, Q8_0   every matrix in that type (what `llama-quantize --pure` writes: llama.cpp's default mix would put the
               output matrix in Q6_K, which leaplm's int8 kernel does not read)
  Q4_K_M       llama.cpp's mix (llama_tensor_get_type): Q6_K for the output matrix (the embedding when tied) and
               for attn_v and ffn_down on the layers `use_more_bits` picks, Q4_K for the rest; a matrix whose rows
               are not whole 256-blocks falls back as llama.cpp's does (Q4_K -> Q5_0, Q6_K -> Q8_0)
1-D tensors (norms, Qwen2's q/k/v biases) are F32: norms 1, biases 0.

The tokenizer is another GGUF file's (SmolLM2-135M's by default, 49152 tokens); vocab "real" pads it with unused
control tokens up to the shape's vocabulary so the embedding and output matrices have their real size, vocab
"tokenizer" keeps the tokenizer's size. The file says what it is in general.name, general.description and
leaplm.synthetic, which `refuse_synthetic` reads.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError
from .synth_shapes import SynthShape

log = logging.getLogger(__name__)

FORMATS = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}          # format -> general.file_type (llama_ftype)
SYNTHETIC_KEY = "leaplm.synthetic"
DEFAULT_STD = 0.02
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class BlockType:
    """A GGML block layout: weights and bytes per block; where the fp16 scales sit and how wide the quants are."""
    name: str
    ggml_id: int
    block: int                  # weights per block
    size: int                   # bytes per block
    q_rms: float                # root-mean-square of the dequantized weight per unit of d (random quants, scales)


# E[w^2] / d^2 for uniform random quants (and, for the K-quants, uniform random 6-bit or int8 sub-block scales):
#   Q4_0: q - 8 over -8..7 -> 21.5;  Q5_0: q - 16 over -16..15 -> 85.5;  Q8_0: int8 -> 5461.5
#   Q4_K: w = d sc q - dmin m, sc, m in 0..63, q in 0..15, dmin = 7.5 d (zero mean) -> 66727
#   Q6_K: w = d s (q - 32), s int8, q in 0..63 -> 5461.5 * 341.5
BLOCK_TYPES = {b.name: b for b in (
    BlockType("Q4_0", 2, 32, 18, 21.5 ** 0.5),
    BlockType("Q5_0", 6, 32, 22, 85.5 ** 0.5),
    BlockType("Q8_0", 8, 32, 34, 5461.5 ** 0.5),
    BlockType("Q4_K", 12, 256, 144, 66727.0 ** 0.5),
    BlockType("Q6_K", 14, 256, 210, (5461.5 * 341.5) ** 0.5),
)}
K_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}   # llama.cpp's type for rows that are not whole 256-blocks


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]      # row-major: [rows, row length] for a matrix
    type_name: str              # "F32" or a BLOCK_TYPES name
    fill: float = 0.0           # value of an F32 tensor

    @property
    def n_bytes(self) -> int:
        n = int(np.prod(self.shape))
        if self.type_name == "F32":
            return 4 * n
        b = BLOCK_TYPES[self.type_name]
        return n // b.block * b.size


@dataclass(frozen=True)
class SynthResult:
    path: Path
    shape: str
    format: str
    vocab: int
    tokenizer_tokens: int       # tokens the borrowed tokenizer has (the rest are padding)
    n_bytes: int                # file size
    tensor_types: dict[str, int]  # type name -> tensor count


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in a _M mix (llama-quant.cpp, use_more_bits)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def matrix_type(fmt: str, kind: str, layer: int, n_layers: int, row_len: int) -> str:
    """The block type of one matrix: kind is a GGUF tensor kind (attn_q, ffn_down, output, ...); `output` stands for
    the output matrix, or the embedding when the model ties them."""
    if fmt != "Q4_K_M":
        return fmt
    t = "Q4_K"
    if kind == "output" or (kind in ("attn_v", "ffn_down") and use_more_bits(layer, n_layers)):
        t = "Q6_K"
    return K_FALLBACK[t] if row_len % 256 else t


def plan_tensors(shape: SynthShape, fmt: str, vocab: int) -> list[TensorPlan]:
    """Every tensor of the file in llama.cpp's names and order: token_embd, the blocks, output_norm, output."""
    if fmt not in FORMATS:
        raise ConfigError("format", f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    H, L = shape.hidden, shape.layers
    for what, n in (("hidden", H), ("q rows", shape.q_rows), ("intermediate", shape.intermediate)):
        if n % 32:
            raise ConfigError("shape", f"{shape.name}: {what} {n} is not a multiple of 32 (the block size)")

    def mat(name: str, kind: str, rows: int, cols: int, layer: int = 0) -> TensorPlan:
        return TensorPlan(name, (rows, cols), matrix_type(fmt, kind, layer, L, cols))

    def vec(name: str, n: int, fill: float) -> TensorPlan:
        return TensorPlan(name, (n,), "F32", fill)

    out = [mat("token_embd.weight", "output" if shape.tied else "token_embd", vocab, H)]
    for i in range(L):
        p = f"blk.{i}."
        out.append(vec(p + "attn_norm.weight", H, 1.0))
        out += [mat(p + "attn_q.weight", "attn_q", shape.q_rows, H, i),
                mat(p + "attn_k.weight", "attn_k", shape.kv_rows, H, i),
                mat(p + "attn_v.weight", "attn_v", shape.kv_rows, H, i)]
        if shape.arch == "qwen2":
            out += [vec(p + "attn_q.bias", shape.q_rows, 0.0), vec(p + "attn_k.bias", shape.kv_rows, 0.0),
                    vec(p + "attn_v.bias", shape.kv_rows, 0.0)]
        if shape.arch == "gemma3":
            out += [vec(p + "attn_q_norm.weight", shape.head_dim, 1.0),
                    vec(p + "attn_k_norm.weight", shape.head_dim, 1.0)]
        out.append(mat(p + "attn_output.weight", "attn_output", H, shape.q_rows, i))
        if shape.arch == "gemma3":
            out.append(vec(p + "post_attention_norm.weight", H, 1.0))
        out += [vec(p + "ffn_norm.weight", H, 1.0),
                mat(p + "ffn_gate.weight", "ffn_gate", shape.intermediate, H, i),
                mat(p + "ffn_up.weight", "ffn_up", shape.intermediate, H, i),
                mat(p + "ffn_down.weight", "ffn_down", H, shape.intermediate, i)]
        if shape.arch == "gemma3":
            out.append(vec(p + "post_ffw_norm.weight", H, 1.0))
    out.append(vec("output_norm.weight", H, 1.0))
    if not shape.tied:
        out.append(mat("output.weight", "output", vocab, H))
    return out


def random_blocks(rng: np.random.Generator, type_name: str, n_blocks: int, std: float) -> np.ndarray:
    """n_blocks random blocks [n_blocks, bytes per block] uint8 whose dequantized weights have standard deviation
    about `std` and mean about 0: random quant bytes, one fp16 d per tensor, random K-quant sub-block scales."""
    b = BLOCK_TYPES[type_name]
    a = rng.integers(0, 256, size=(n_blocks, b.size), dtype=np.uint8)
    d = np.float16(std / b.q_rms)
    if type_name == "Q6_K":
        a[:, 208:210] = np.frombuffer(d.tobytes(), np.uint8)            # ql 128, qh 64, int8 scales 16, then d
    elif type_name == "Q4_K":
        a[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    else:                       # d first; its sign random per block: quants biased by -1/2 average out to 0
        signs = np.where(rng.random(n_blocks) < 0.5, -d, d).astype(np.float16)      # [n_blocks]
        a[:, 0:2] = signs.view(np.uint8).reshape(n_blocks, 2)
    if type_name == "Q4_K":
        a[:, 2:4] = np.frombuffer(np.float16(float(d) * 7.5).tobytes(), np.uint8)   # dmin: zero mean
    return a


def write_synthetic_gguf(shape: SynthShape, fmt: str, out: str | Path, tokenizer_from: str | Path,
                         vocab: str = "real", seed: int = 0, std: float = DEFAULT_STD,
                         chunk_bytes: int = CHUNK_BYTES) -> SynthResult:
    """Write the file; see the module docstring. Memory: one chunk of blocks (chunk_bytes) plus the tokenizer."""
    import gguf

    from .gguf import parse_gguf

    if vocab not in ("real", "tokenizer"):
        raise ConfigError("vocab", f"vocab {vocab!r}: expected 'real' or 'tokenizer'")
    tok_path = Path(tokenizer_from).expanduser()
    if not tok_path.is_file():
        raise ConfigError("tokenizer_from", f"{tokenizer_from!s} is not a file")
    tf = parse_gguf(tok_path, "tokenizer_from").fields
    if "tokenizer.ggml.tokens" not in tf:
        raise ConfigError("tokenizer_from", f"{tok_path}: the file has no tokenizer (tokenizer.ggml.tokens)")
    n_tok = len(tf["tokenizer.ggml.tokens"])
    n_vocab = shape.vocab if vocab == "real" else n_tok
    if n_vocab < n_tok:
        raise ConfigError("vocab", f"{shape.name} has {shape.vocab} rows, fewer than the tokenizer's {n_tok} "
                                   "tokens: use vocab 'tokenizer'")
    plan = plan_tensors(shape, fmt, n_vocab)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(str(part), shape.arch)
    _metadata(w, shape, fmt, n_vocab, n_tok, tf, tok_path)
    for t in plan:
        raw = None if t.type_name == "F32" else gguf.GGMLQuantizationType[t.type_name]
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    for i, t in enumerate(plan):
        w.write_padding(f, f.tell())
        _write_tensor(f, t, np.random.default_rng([seed, i]), std, chunk_bytes)
        w.write_padding(f, t.n_bytes)
    w.close()
    part.replace(out)                 # whole file or nothing
    counts: dict[str, int] = {}
    for t in plan:
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    return SynthResult(out, shape.name, fmt, n_vocab, n_tok, out.stat().st_size, counts)


def _write_tensor(f, t: TensorPlan, rng: np.random.Generator, std: float, chunk_bytes: int) -> None:
    if t.type_name == "F32":
        np.full(t.shape, t.fill, np.float32).tofile(f)
        return
    b = BLOCK_TYPES[t.type_name]
    total = t.n_bytes // b.size
    step = max(1, chunk_bytes // b.size)
    for start in range(0, total, step):
        random_blocks(rng, t.type_name, min(step, total - start), std).tofile(f)


def _metadata(w, shape: SynthShape, fmt: str, n_vocab: int, n_tok: int, tf: dict, tok_path: Path) -> None:
    import gguf

    a = shape.arch
    w.add_name(f"{shape.name} random weights (synthetic)")
    w.add_description(f"random weights, shape of {shape.name} ({shape.source}), synthetic: for benchmarks only; "
                      f"tokenizer borrowed from {tok_path.name} ({n_tok} tokens"
                      + (f", padded to {n_vocab} with unused control tokens)" if n_vocab > n_tok else ")"))
    w.add_bool(SYNTHETIC_KEY, True)
    w.add_string(SYNTHETIC_KEY + ".shape", shape.name)
    w.add_uint32("general.file_type", FORMATS[fmt])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32(f"{a}.context_length", shape.context)
    w.add_uint32(f"{a}.embedding_length", shape.hidden)
    w.add_uint32(f"{a}.block_count", shape.layers)
    w.add_uint32(f"{a}.feed_forward_length", shape.intermediate)
    w.add_uint32(f"{a}.attention.head_count", shape.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", shape.kv_heads)
    w.add_uint32(f"{a}.attention.key_length", shape.head_dim)
    w.add_uint32(f"{a}.attention.value_length", shape.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", shape.norm_eps)
    w.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    w.add_uint32(f"{a}.vocab_size", n_vocab)
    if a != "gemma3":
        w.add_uint32(f"{a}.rope.dimension_count", shape.head_dim)
    if shape.sliding_window:
        w.add_uint32(f"{a}.attention.sliding_window", shape.sliding_window)
    tokens = list(tf["tokenizer.ggml.tokens"])
    types = [int(x) for x in np.asarray(tf.get("tokenizer.ggml.token_type", np.ones(n_tok, np.int32)))]
    tokens += [f"<|synthetic_unused_{i}|>" for i in range(n_tok, n_vocab)]
    types += [int(gguf.TokenType.UNUSED)] * (n_vocab - n_tok)
    w.add_tokenizer_model(str(tf.get("tokenizer.ggml.model", "gpt2")))
    if "tokenizer.ggml.pre" in tf:
        w.add_tokenizer_pre(str(tf["tokenizer.ggml.pre"]))
    w.add_token_list(tokens)
    w.add_token_types(types)
    skip = {"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}
    for key, v in tf.items():
        if not key.startswith("tokenizer.") or key in skip:
            continue
        if key == "tokenizer.ggml.merges":
            w.add_token_merges(list(v))
        elif isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            log.info("synthetic GGUF: tokenizer field %s not copied (%s)", key, type(v).__name__)


def is_synthetic(fields: dict) -> bool:
    """Whether a parsed GGUF file's metadata marks it as random weights (written here)."""
    return bool(fields.get(SYNTHETIC_KEY, False))


def refuse_synthetic(path: str | None, allow: bool, field: str = "model") -> None:
    """ConfigError when `path` is a synthetic GGUF file and `allow` is False: its text is noise from random
    weights. Benchmarks pass allow=True (they time the shape, not the words)."""
    from .gguf import is_gguf, parse_gguf

    if allow or not path or not is_gguf(path) or not Path(path).expanduser().is_file():
        return
    try:
        g = parse_gguf(Path(path).expanduser(), field)
    except ConfigError:
        return                       # not a readable GGUF file: the loader refuses it with its own message
    if is_synthetic(g.fields):
        raise ConfigError(field, f"{path}: random weights (shape of {g.fields.get(SYNTHETIC_KEY + '.shape')}), "
                                 "synthetic: for benchmarks only; its text is noise. Pass --allow-synthetic "
                                 "to generate from it anyway")

"""Load a GGUF file (llama.cpp's format) into the native Llama-family model, dequantized at load.

The file is read with the `gguf` package (the reader llama.cpp maintains). Its metadata is mapped onto a
Hugging Face config, and its tensors onto Hugging Face parameter names, by transformers' own GGUF integration
(`load_gguf_checkpoint`, which also undoes llama.cpp's q/k row permutation); the tokenizer, its special tokens
and chat template come from transformers' GGUF tokenizer converter. So a GGUF file loads as the Hugging Face
checkpoint it was converted from would, and greedy output equals `from_pretrained(dir, gguf_file=...)`.

Everything is checked before the (slow) dequantization: the magic, the architecture and every tensor's type,
each refused with one line naming the file and the GGUF field.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# general.architecture values the native model runs (llama.cpp writes mistral files as "llama")
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# tensor types gguf.quants.dequantize handles and we test or trust (block quants and K-quants)
TENSOR_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def is_gguf(name: str) -> bool:
    """True when `name` is a file whose name ends in .gguf or that starts with the GGUF magic."""
    p = Path(name).expanduser()
    if p.suffix.lower() == ".gguf":
        return True
    if p.is_file():
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    return False


@dataclass
class GGUFInfo:
    """What the file says before any tensor is read."""
    path: Path
    architecture: str
    tensor_types: dict[str, str]        # tensor name -> GGML type name
    add_bos_token: bool | None          # tokenizer.ggml.add_bos_token, None when absent
    n_elements: int = 0                 # weights in all tensors (what a dequantized copy holds)


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def inspect_gguf(name: str, field: str = "model", check_types: bool = True) -> GGUFInfo:
    """Open and check a GGUF file; ConfigError naming the file and the GGUF field on anything we cannot run.
    check_types False: any tensor type (libllama computes on the file's own types; it refuses what it cannot)."""
    p = Path(name).expanduser()
    if not p.exists():
        raise ConfigError(field, f"GGUF file {name!r} does not exist")
    if not p.is_file():
        raise ConfigError(field, f"{name!r} is not a file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConfigError(field, f"{name}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConfigError(field, f"{name}: reading GGUF files needs the 'gguf' package (pip install gguf)") from None
    try:
        reader = GGUFReader(str(p))
    except Exception as e:   # truncated or corrupt: numpy memmap / struct errors of many kinds
        raise ConfigError(field, f"{name}: unreadable GGUF file, truncated or corrupt "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(field, f"{name}: general.architecture {arch!r} is not supported "
                                 f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    bad = {n: t for n, t in types.items() if t not in TENSOR_TYPES} if check_types else {}
    if bad:
        n, t = next(iter(bad.items()))
        raise ConfigError(field, f"{name}: tensor {n!r} has type {t}, which leaplm cannot dequantize "
                                 f"(supported: {', '.join(sorted(TENSOR_TYPES))}; {len(bad)} tensors affected)")
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ConfigError(field, f"{name}: the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    return GGUFInfo(p, arch, types, None if add_bos is None else bool(add_bos),
                    sum(int(t.n_elements) for t in reader.tensors))


def file_dtype(info: GGUFInfo) -> str:
    """The compute dtype --dtype auto picks for a GGUF file: its float type when every tensor is a float
    (norms are F32 in every file, so an F16 file counts as float16), float32 for quantized files (dequantized)."""
    kinds = set(info.tensor_types.values()) - {"F32"}
    return {frozenset(): "float32", frozenset({"F16"}): "float16",
            frozenset({"BF16"}): "bfloat16"}.get(frozenset(kinds), "float32")


def read_gguf_checkpoint(info: GGUFInfo, dtype: torch.dtype, field: str = "model") -> tuple[dict, dict[str, torch.Tensor]]:
    """(Hugging Face config dict, state dict with Hugging Face names in `dtype`) of a checked GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    name = str(info.path)
    try:
        hf_cfg = AutoConfig.for_model(**load_gguf_checkpoint(name, return_tensors=False)["config"])
        with torch.device("meta"):                  # only its parameter names are needed, for the name map
            skeleton = AutoModelForCausalLM.from_config(hf_cfg)
        sd = load_gguf_checkpoint(name, return_tensors=True, model_to_load=skeleton, torch_dtype=dtype)["tensors"]
    except (ValueError, KeyError) as e:
        raise ConfigError(field, f"{name}: cannot map the GGUF file onto a {info.architecture} model "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return hf_cfg.to_dict(), sd


def read_gguf_config(info: GGUFInfo, field: str = "model") -> dict:
    """The Hugging Face config dict of a checked GGUF file, from its metadata alone (no tensor is read)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        return AutoConfig.for_model(**load_gguf_checkpoint(str(info.path), return_tensors=False)["config"]).to_dict()
    except (ValueError, KeyError) as e:
        raise ConfigError(field, f"{info.path}: cannot map the GGUF metadata onto a {info.architecture} config "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def load_gguf_tokenizer(info: GGUFInfo, field: str = "model"):
    """A transformers fast tokenizer built from the file's metadata (vocabulary, merges, special tokens,
    chat template, add_bos_token)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(info.path.parent), gguf_file=info.path.name)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(field, f"{info.path}: cannot build a tokenizer from tokenizer.ggml.* "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None

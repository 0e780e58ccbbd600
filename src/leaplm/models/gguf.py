"""Load a GGUF file (llama.cpp's format): its metadata, tensors and tokenizer.

The file is memory-mapped and its header parsed here (parse_gguf: the metadata, including the tokenizer's
vocabulary and merges, in well under a second where the `gguf` package's reader takes seconds); tensor data are
views of the mapping, read only when used. Two ways to load its weights:

  as stored     Q8_0 / Q4_0 / Q4_1 blocks go to leaplm's int8 kernel unchanged (models/gguf_kernel.py): no
                full-precision copy of a matrix is ever made.
  dequantized   everything else (a float compute dtype, K-quants, --quantization int8/int4): metadata are mapped
                onto a Hugging Face config and tensors onto Hugging Face parameter names by transformers' own GGUF
                integration (`load_gguf_checkpoint`, which also undoes llama.cpp's q/k row permutation), so the
                file loads as the checkpoint it was converted from would, and greedy output equals
                `from_pretrained(dir, gguf_file=...)`.

The tokenizer, its special tokens and chat template come from transformers' GGUF tokenizer converter, and the
Hugging Face config from transformers' key table, both over the metadata parsed here (gguf_hf.py: transformers'
own readers would read the file again, for seconds); built once per file and kept in the start-up cache
(startup_cache.py): a second load reads neither the metadata arrays nor transformers' GGUF code.

Everything is checked before any weight is read: the magic, the architecture and every tensor's type and extent,
each refused with one line naming the file and the GGUF field.
"""
from __future__ import annotations

import json
import logging
import mmap
import struct
from dataclasses import dataclass, field as dc_field
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from .arch import BY_GGUF_ARCHITECTURE, gguf_config

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# general.architecture values the native model runs (llama.cpp writes mistral files as "llama")
ARCHITECTURES = {g: a.name for g, a in BY_GGUF_ARCHITECTURE.items()}   # models/arch: one description a family
# tensor types gguf.quants.dequantize handles and we test or trust (block quants and K-quants)
TENSOR_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
DEFAULT_ALIGNMENT = 32
# GGML tensor types: id -> (name, weights per block, bytes per block), as the gguf package's constants say
# (GGML_QUANT_SIZES; tests/models/test_gguf_kernel.py compares them). Held here because importing the gguf package
# costs a tenth of a second at every start; an id missing here is looked up in the package.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 30: ("BF16", 1, 2)}

# GGUF metadata value types: id -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
# bytes fully dequantized from GGUF files by this process (read_gguf_checkpoint, dequantize_tensor): what the
# kernel path keeps at 0
DEQUANTIZED_BYTES = [0]


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry in the file's header."""
    name: str
    type_name: str                  # GGML type, e.g. 'Q4_1'
    dims: tuple[int, ...]           # as the file lists them: the fastest-varying first ([K, N] for a matrix)
    offset: int                     # of its data from the start of the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major shape (torch's order): [N, K] for a matrix."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata, tensor entries, and the read-only mapping their data are views of."""
    path: Path
    fields: dict[str, object]       # key -> int | float | bool | str | list (string arrays) | np.ndarray
    tensors: dict[str, GGUFTensor]
    data: mmap.mmap | None = dc_field(default=None, repr=False)

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes as a view of the mapping: quantized types [N, bytes per row] uint8, float types in
        their dtype with the tensor's row-major shape. No copy; pages are read when touched."""
        t = self.tensors[name]
        if t.type_name in ("F32", "F16"):
            dt = np.float32 if t.type_name == "F32" else np.float16
            return np.frombuffer(self.data, dt, t.n_elements, t.offset).reshape(t.shape)
        a = np.frombuffer(self.data, np.uint8, t.n_bytes, t.offset)
        rows = t.n_elements // t.dims[0] if t.dims else 1
        return a.reshape(rows, -1)

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process's resident memory once its data have been copied out (they
        stay in the page cache): the mapping's resident size does not add up to the whole file while loading."""
        if self.data is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        t = self.tensors[name]
        page = mmap.PAGESIZE
        start = t.offset // page * page
        try:
            self.data.madvise(mmap.MADV_DONTNEED, start, t.offset + t.n_bytes - start)
        except (OSError, ValueError):
            pass


_opened: dict[tuple, GGUFFile] = {}


def parse_gguf(path: str | Path, field: str = "model") -> GGUFFile:
    """Map and parse a GGUF file (v2 or v3, little-endian), once per process per file version. ConfigError naming
    the file on anything malformed or truncated."""
    p = Path(path)
    st = p.stat()
    k = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if k in _opened:
        return _opened[k]
    try:
        with open(p, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ConfigError(field, f"{p}: unreadable GGUF file ({type(e).__name__}: {e})") from None
    try:
        g = _parse(p, mm)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError) as e:
        mm.close()
        raise ConfigError(field, f"{p}: unreadable GGUF file, truncated or corrupt "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    _opened.clear()                  # one file at a time is the common case; keep the mapping count small
    _opened[k] = g
    return g


def _parse(p: Path, mm: mmap.mmap) -> GGUFFile:
    size = len(mm)
    if mm[:4] != GGUF_MAGIC:
        raise ValueError(f"starts with {bytes(mm[:4])!r}, not {GGUF_MAGIC!r}")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (2 and 3 are read)")
    off = 24
    unpack = struct.unpack_from

    def string(o: int) -> tuple[str, int]:
        (n,) = unpack("<Q", mm, o)
        if o + 8 + n > size:
            raise ValueError("a string runs past the end of the file")
        return mm[o + 8: o + 8 + n].decode("utf-8", errors="replace"), o + 8 + n

    def value(vt: int, o: int) -> tuple[object, int]:
        if vt in _SCALARS:
            fmt = "<" + _SCALARS[vt]
            return unpack(fmt, mm, o)[0], o + struct.calcsize(fmt)
        if vt == 8:
            return string(o)
        if vt == 9:
            et, n = unpack("<IQ", mm, o)
            o += 12
            if et in _NP:
                dt = np.dtype(_NP[et])
                if o + n * dt.itemsize > size:
                    raise ValueError("an array runs past the end of the file")
                return np.frombuffer(mm, dt, n, o).copy(), o + n * dt.itemsize
            if et == 8:
                out = []
                append = out.append
                for _ in range(n):
                    (m,) = unpack("<Q", mm, o)
                    append(mm[o + 8: o + 8 + m].decode("utf-8", errors="replace"))
                    o += 8 + m
                if o > size:
                    raise ValueError("a string array runs past the end of the file")
                return out, o
            items = []
            for _ in range(n):
                v, o = value(et, o)
                items.append(v)
            return items, o
        raise ValueError(f"unknown metadata value type {vt}")

    fields: dict[str, object] = {}
    for _ in range(n_kv):
        key, off = string(off)
        (vt,) = unpack("<I", mm, off)
        fields[key], off = value(vt, off + 4)
    entries = []
    for _ in range(n_tensors):
        name, off = string(off)
        (nd,) = unpack("<I", mm, off)
        if nd > 8:
            raise ValueError(f"tensor {name!r} has {nd} dimensions")
        dims = unpack(f"<{nd}Q", mm, off + 4)
        tt, t_off = unpack("<IQ", mm, off + 4 + 8 * nd)
        off += 4 + 8 * nd + 12
        type_name, block, type_size = ggml_type(tt, name)
        n = 1
        for d in dims:
            n *= d
        if dims and dims[0] % block:
            raise ValueError(f"tensor {name!r}: rows of {dims[0]} are not whole blocks of {block}")
        entries.append((name, type_name, tuple(int(d) for d in dims), t_off, n // block * type_size))
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align} is not a power of two")
    start = -(-off // align) * align
    tensors = {}
    for name, tn, dims, t_off, nb in entries:
        if start + t_off + nb > size:
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated)")
        tensors[name] = GGUFTensor(name, tn, dims, start + t_off, nb)
    return GGUFFile(p, fields, tensors, mm)


def ggml_type(type_id: int, tensor: str) -> tuple[str, int, int]:
    """(name, weights per block, bytes per block) of a GGML tensor type id; ValueError naming the tensor."""
    if type_id in GGML_TYPES:
        return GGML_TYPES[type_id]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qt = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"tensor {tensor!r} has unknown type id {type_id}") from None
    return (qt.name, *GGML_QUANT_SIZES[qt])


def dequantize_tensor(g: GGUFFile, name: str) -> torch.Tensor:
    """A tensor as fp32 (gguf.quants.dequantize), counted in DEQUANTIZED_BYTES."""
    from gguf.quants import dequantize
    from gguf.constants import GGMLQuantizationType

    t = g.tensors[name]
    a = dequantize(g.raw(name), GGMLQuantizationType[t.type_name])
    out = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).reshape(t.shape)
    DEQUANTIZED_BYTES[0] += out.numel() * 4
    return out


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
    n_bytes: int = 0                    # bytes of all tensors as stored


def inspect_gguf(name: str, field: str = "model", check_types: bool = True, check_arch: bool = True) -> GGUFInfo:
    """Open and check a GGUF file; ConfigError naming the file and the GGUF field on anything we cannot run.
    check_types False: any tensor type (libllama computes on the file's own types; it refuses what it cannot).
    check_arch False: any general.architecture (libllama decides what it can load, not leaplm's list)."""
    p = Path(name).expanduser()
    if not p.exists():
        raise ConfigError(field, f"GGUF file {name!r} does not exist")
    if not p.is_file():
        raise ConfigError(field, f"{name!r} is not a file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConfigError(field, f"{name}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    g = parse_gguf(p, field)
    arch = g.fields.get("general.architecture")
    if check_arch and arch not in ARCHITECTURES:
        raise ConfigError(field, f"{name}: general.architecture {arch!r} is not supported "
                                 f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    types = {t.name: t.type_name for t in g.tensors.values()}
    bad = {n: t for n, t in types.items() if t not in TENSOR_TYPES} if check_types else {}
    if bad:
        n, t = next(iter(bad.items()))
        raise ConfigError(field, f"{name}: tensor {n!r} has type {t}, which leaplm cannot dequantize "
                                 f"(supported: {', '.join(sorted(TENSOR_TYPES))}; {len(bad)} tensors affected)")
    if "tokenizer.ggml.tokens" not in g.fields:
        raise ConfigError(field, f"{name}: the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    add_bos = g.fields.get("tokenizer.ggml.add_bos_token")
    return GGUFInfo(p, arch, types, None if add_bos is None else bool(add_bos),
                    sum(t.n_elements for t in g.tensors.values()), sum(t.n_bytes for t in g.tensors.values()))


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
        hf_cfg = AutoConfig.for_model(**gguf_config(info.architecture,
                                                    load_gguf_checkpoint(name, return_tensors=False)["config"]))
        with torch.device("meta"):                  # only its parameter names are needed, for the name map
            skeleton = AutoModelForCausalLM.from_config(hf_cfg)
        sd = load_gguf_checkpoint(name, return_tensors=True, model_to_load=skeleton, torch_dtype=dtype)["tensors"]
        DEQUANTIZED_BYTES[0] += sum(t.numel() * t.element_size() for t in sd.values())
    except (ValueError, KeyError) as e:
        raise ConfigError(field, f"{name}: cannot map the GGUF file onto a {info.architecture} model "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return hf_cfg.to_dict(), sd


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def cache_key(info: GGUFInfo) -> str:
    """The start-up cache key of what transformers builds from this file's metadata (config, tokenizer), and of the
    code that maps the metadata (a changed family description or mapping reads the file again)."""
    from ..startup_cache import code_identity, file_identity, key
    from . import arch, gguf_hf

    mapping = code_identity(gguf_hf.__file__, *sorted(str(p) for p in Path(arch.__file__).parent.glob("*.py")))
    return key("gguf-metadata", file_identity(info.path), _transformers_version(), mapping)


def _fields_and_tensors(info: GGUFInfo, field: str) -> tuple[dict, dict]:
    g = parse_gguf(info.path, field)
    return g.fields, g.tensors


def read_gguf_config(info: GGUFInfo, field: str = "model") -> dict:
    """The Hugging Face config dict of a checked GGUF file, from its metadata alone (no tensor is read); built by
    transformers once per file and then read from the start-up cache."""
    from .. import startup_cache

    k = cache_key(info)
    hit = startup_cache.read_json("gguf-config", k)
    if hit is not None and isinstance(hit.get("config"), dict):
        return hit["config"]
    from transformers import AutoConfig

    from .gguf_hf import hf_config_dict

    try:
        cfg = AutoConfig.for_model(**gguf_config(info.architecture,
                                                 hf_config_dict(*_fields_and_tensors(info, field)))).to_dict()
    except (ValueError, KeyError) as e:
        raise ConfigError(field, f"{info.path}: cannot map the GGUF metadata onto a {info.architecture} config "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    try:
        cfg = json.loads(json.dumps(cfg))     # as the cache will return it (JSON keys are strings)
    except (TypeError, ValueError):           # a value JSON cannot hold: keep it for this process only
        return cfg
    startup_cache.write_json("gguf-config", k, {"config": cfg})
    return cfg


_tokenizers: dict[str, object] = {}


def load_gguf_tokenizer(info: GGUFInfo, field: str = "model"):
    """A transformers fast tokenizer built from the file's metadata (vocabulary, merges, special tokens,
    chat template, add_bos_token): converted by transformers once per file and saved in the start-up cache, then
    loaded from there (the same tokenizer: tests/models/test_gguf_fast.py checks it)."""
    from .. import startup_cache

    k = cache_key(info)
    if k in _tokenizers:
        return _tokenizers[k]
    d = startup_cache.entry_dir("gguf-tokenizer", k)
    tok = None
    if (d / "done").exists() and not startup_cache.recalibrating() and not startup_cache.disabled():
        try:
            tok = CachedTokenizer(d)
        except (ValueError, KeyError, OSError, Exception) as e:  # noqa: B014  (tokenizers raises its own types)
            log.info("start-up cache: tokenizer at %s unreadable (%s); converting the file's again", d, e)
    if tok is None:
        from .gguf_hf import convert_tokenizer, hf_config_dict

        try:
            tok = convert_tokenizer(info.path, hf_config_dict(*_fields_and_tensors(info, field)))
        except (ValueError, KeyError, OSError) as e:
            raise ConfigError(field, f"{info.path}: cannot build a tokenizer from tokenizer.ggml.* "
                                     f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        if not startup_cache.disabled():
            try:
                import shutil
                import tempfile

                d.parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=".tok"))
                tok.save_pretrained(str(tmp))
                (tmp / "done").write_text("")
                shutil.rmtree(d, ignore_errors=True)
                tmp.rename(d)
            except OSError as e:
                log.info("start-up cache: cannot keep the tokenizer in %s (%s)", d, e)
    _tokenizers[k] = tok
    return tok


def _token_text(t) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


class CachedTokenizer:
    """A GGUF file's tokenizer as transformers converted and saved it (tokenizer.json, tokenizer_config.json,
    chat_template.jinja), read with the `tokenizers` library alone: encoding, the special tokens' ids and the chat
    template without importing transformers (about a second of start-up). Encoding, the vocabulary and its size are
    the Rust tokenizer's own, as in transformers' fast tokenizers; anything else (apply_chat_template, get_vocab, convert_ids_to_tokens, ...)
    loads the transformers tokenizer from the same files on first use and is answered by it."""

    def __init__(self, d: Path):
        from tokenizers import Tokenizer

        self._dir = d
        self._full = None
        self.backend_tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        tmpl = d / "chat_template.jinja"
        self.chat_template = tmpl.read_text() if tmpl.exists() else cfg.get("chat_template")
        self.bos_token, self.eos_token = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend_tokenizer.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend_tokenizer.token_to_id(self.eos_token)

    def __call__(self, text, add_special_tokens: bool = True, **kw):
        if kw or not isinstance(text, str):
            return self.transformers_tokenizer()(text, add_special_tokens=add_special_tokens, **kw)
        return {"input_ids": self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def transformers_tokenizer(self):
        """The transformers tokenizer from the same files (loaded once, on first need)."""
        if self._full is None:
            from transformers import AutoTokenizer

            self._full = AutoTokenizer.from_pretrained(str(self._dir))
        return self._full

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included (what transformers' fast tokenizers answer, from the same object)."""
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_full", "_dir", "backend_tokenizer"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)

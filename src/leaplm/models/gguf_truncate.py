"""A GGUF file cut to some of its layers: what a start-up timing of libllama runs instead of the whole model.

`--backend auto` times a forward on both engines on a file's first start (models/backend_costs.py). Every
decoder layer of a file has the same shapes, so a few layers, the embedding lookup, the final norm and the output
projection show how the engines compare at a fraction of the cost (an 8B file's first start would otherwise time
32 layers on both). libllama runs only whole files, so the cut is a file of its own: the header copied byte for
byte, `{arch}.block_count` set to the layers kept, the tensors of those layers (renumbered 0, 1, ... in the order
asked) and of no layer copied after it, aligned as the header says.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Sequence

from .gguf import DEFAULT_ALIGNMENT, GGML_TYPES, parse_gguf

_LAYER = re.compile(r"^blk\.(\d+)\.")
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF value types


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def _kv_section(mm, n_kv: int, key: str) -> tuple[int, int]:
    """(offset of `key`'s u32 value, end of the metadata section) in a GGUF v2/v3 header."""
    off, at = 24, -1
    unpack = struct.unpack_from

    def skip(vt: int, o: int) -> int:
        if vt in _SCALAR_BYTES:
            return o + _SCALAR_BYTES[vt]
        if vt == 8:
            return o + 8 + unpack("<Q", mm, o)[0]
        if vt == 9:
            et, n = unpack("<IQ", mm, o)
            o += 12
            if et in _SCALAR_BYTES:
                return o + n * _SCALAR_BYTES[et]
            for _ in range(n):
                o = skip(et, o)
            return o
        raise ValueError(f"unknown metadata value type {vt}")

    for _ in range(n_kv):
        n = unpack("<Q", mm, off)[0]
        k = bytes(mm[off + 8:off + 8 + n]).decode("utf-8", errors="replace")
        off += 8 + n
        (vt,) = unpack("<I", mm, off)
        if k == key:
            if vt != 4:
                raise ValueError(f"{key} is of GGUF type {vt}, not u32")
            at = off + 4
        off = skip(vt, off + 4)
    if at < 0:
        raise ValueError(f"no {key} in the header")
    return at, off


def kept_layers(total: int, layers: int | Sequence[int]) -> list[int]:
    """The layer indices a cut keeps, in order: an int n is the first n; a sequence is those layers. ValueError when
    they are not distinct layers of the file, or are all of them."""
    keep = list(range(layers)) if isinstance(layers, int) else [int(i) for i in layers]
    if len(keep) >= total:
        raise ValueError(f"the file has {total} layers, not more than {len(keep)}")
    if len(set(keep)) != len(keep) or any(not 0 <= i < total for i in keep):
        raise ValueError(f"layers to keep must be distinct indices in [0, {total}), got {keep}")
    return keep


def truncate_gguf(path: str | Path, layers: int | Sequence[int], out: str | Path) -> Path:
    """Write to `out` the file `path` with only some of its decoder layers: the first `layers` (an int) or the
    layers listed, numbered 0, 1, ... in the order given (every tensor outside a layer kept). ValueError when the
    file has no more layers than that (kept_layers)."""
    g = parse_gguf(path)
    arch = g.fields["general.architecture"]
    total = int(g.fields[f"{arch}.block_count"])
    new_index = {old: new for new, old in enumerate(kept_layers(total, layers))}
    mm = g.data
    _, _, n_kv = struct.unpack_from("<IQQ", mm, 4)
    count_at, kv_end = _kv_section(mm, n_kv, f"{arch}.block_count")
    keep = [t for t in g.tensors.values() if layer_of(t.name) is None or layer_of(t.name) in new_index]
    type_ids = {name: i for i, (name, _, _) in GGML_TYPES.items()}
    align = int(g.fields.get("general.alignment", DEFAULT_ALIGNMENT))
    header = bytearray(mm[:kv_end])
    struct.pack_into("<Q", header, 8, len(keep))                   # n_tensors
    struct.pack_into("<I", header, count_at, len(new_index))       # {arch}.block_count
    offsets, at = [], 0
    for t in keep:
        at = -(-at // align) * align
        offsets.append(at)
        at += t.n_bytes
    for t, o in zip(keep, offsets):
        i = layer_of(t.name)
        name = (t.name if i is None else _LAYER.sub(f"blk.{new_index[i]}.", t.name, count=1)).encode()
        header += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.dims))
        header += struct.pack(f"<{len(t.dims)}Q", *t.dims) + struct.pack("<IQ", _type_id(t.type_name, type_ids), o)
    header += b"\0" * (-len(header) % align)
    out = Path(out)
    view = memoryview(mm)
    with open(out, "wb") as f:
        f.write(header)
        for t, o in zip(keep, offsets):
            f.write(b"\0" * (len(header) + o - f.tell()))
            f.write(view[t.offset:t.offset + t.n_bytes])
    return out


def scratch_dir(nbytes: int) -> str | None:
    """Where a cut file is written: /dev/shm (memory) where it has room for twice `nbytes`, else the temporary
    directory (None). A cut copies the embedding and the output projection whatever the layers kept (about 0.7 GB
    of an 8B file): to memory it takes a few seconds on a loaded 2-core machine, to its disk five times that."""
    import shutil

    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 2 * nbytes else None
    except OSError:
        return None


def cut_bytes(path: str | Path, layers: int | Sequence[int]) -> int:
    """The size of truncate_gguf(path, layers)'s tensors."""
    g = parse_gguf(path)
    keep = set(range(layers) if isinstance(layers, int) else layers)
    return sum(t.n_bytes for t in g.tensors.values() if layer_of(t.name) is None or layer_of(t.name) in keep)


def _type_id(type_name: str, known: dict[str, int]) -> int:
    if type_name in known:
        return known[type_name]
    from gguf.constants import GGMLQuantizationType

    return int(GGMLQuantizationType[type_name])

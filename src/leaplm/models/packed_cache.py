"""A GGUF file's linears in the int8 kernel's layout, kept in the start-up cache and memory-mapped on the next start.

Moving a file's blocks into the kernel's row-group layout (quant/linear.py pack_gguf, pack) reads and rewrites
every weight: 3-4 s for a 700 MB Llama-3.2-1B-shaped Q4_0 file on a 2-core VM, most of a second start. The layout
depends only on the file and on the packing code, so the first start writes it once (one torch file per GGUF file,
under <cache dir>/startup/packed/<key>/) and later starts map it: no weight is read until a forward reads it, and its
pages are the page cache's (file-backed), not a second copy. The key holds the file's identity and a hash of the
code that packs (startup_cache.code_identity), so a file replaced by another or a changed layout packs again; the
new entry then removes the old one of the same path (each is about the file's size), and none is written where the
disk has less than twice its size free.
LEAPLM_NO_STARTUP_CACHE=1 neither reads nor writes it; LEAPLM_RECALIBRATE=1 writes it anew.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .. import startup_cache

log = logging.getLogger(__name__)

KIND = "packed"
FILE = "linears.pt"
SOURCE = "source"        # beside FILE: the GGUF file's resolved path (a newer entry of the same file replaces it)


def _key(path: str) -> str:
    here = Path(__file__).resolve().parent
    code = startup_cache.code_identity(str(here / "packed_cache.py"), str(here / "gguf_kernel.py"),
                                       str(here.parent / "quant" / "linear.py"), str(here.parent / "quant" / "formats.py"))
    return startup_cache.key("packed", startup_cache.file_identity(path), code)


def entry_dir_of(path: str):
    """The cache directory of the file's packed linears (it may not exist)."""
    return startup_cache.entry_dir(KIND, _key(path))


def load(path: str) -> dict[str, list] | None:
    """{linear name: [PackedWeight per row block]} from the cache (memory-mapped), or None when absent or disabled."""
    if startup_cache.disabled() or startup_cache.recalibrating():
        return None
    f = startup_cache.entry_dir(KIND, _key(path)) / FILE
    if not f.exists():
        return None
    from ..quant.linear import PackedWeight

    try:
        raw = torch.load(f, mmap=True, weights_only=True)
        return {name: [PackedWeight(p["q"], p["scale"], p.get("minv"), int(p["rows"]), p.get("ss"), p.get("ms"))
                       for p in parts]
                for name, parts in raw.items()}
    except Exception as e:              # a truncated or foreign file: pack from the GGUF file again
        log.info("packed-weight cache: cannot read %s (%s: %s)", f, type(e).__name__, e)
        return None


def save(path: str, linears: dict) -> None:
    """Write {linear name: QuantizedLinear | SplitLinear} (packed on the extension) atomically; an unwritable cache
    only logs."""
    if startup_cache.disabled():
        return
    out = {}
    for name, lin in linears.items():
        parts = getattr(lin, "parts", [lin])
        if any(getattr(p, "packed", None) is None for p in parts):
            return                          # not every linear on the kernel: nothing worth keeping
        out[name] = [{"q": p.packed.q, "scale": p.packed.scale, "rows": p.packed.rows,
                      **{f: getattr(p.packed, f) for f in ("minv", "ss", "ms") if getattr(p.packed, f) is not None}}
                     for p in parts]
    d = startup_cache.entry_dir(KIND, _key(path))
    size = sum(t.nbytes for parts in out.values() for p in parts for t in p.values() if isinstance(t, torch.Tensor))
    try:
        d.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(d).free < 2 * size:      # the cache never fills the disk it shares with the user
            log.info("packed-weight cache: not written (%s free, %d bytes to write)", shutil.disk_usage(d).free, size)
            return
        fd, tmp = tempfile.mkstemp(dir=d, prefix="partial-", suffix=".pt")   # torch.save refuses a leading dot
        os.close(fd)
        torch.save(out, tmp)
        os.replace(tmp, d / FILE)
        (d / SOURCE).write_text(os.path.realpath(path))
        remove_stale(d, path)
    except (OSError, RuntimeError) as e:
        log.info("packed-weight cache: cannot write %s (%s)", d, e)


def remove_stale(keep, path: str) -> None:
    """Remove the other entries packed from the same file (an earlier version of it, or of the packing code): each
    is about the size of the file and would never be read again. A process that still maps one keeps its pages."""
    src = os.path.realpath(path)
    for other in keep.parent.iterdir():
        try:
            if other != keep and (other / SOURCE).read_text() == src:
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            continue

"""What a start-up measures or builds once per machine and model file, kept on disk so the next process skips it.

Entries are small JSON files (or directories, for a tokenizer) under <cache dir>/startup/<kind>/<key>/, where
the cache dir is $LEAPLM_CACHE or ~/.cache/leaplm. A key is a hash of everything the entry depends on:

  the model file     its size, modification time and a hash of its first and last MiB (file_identity): a file
                     replaced by another of the same name gets a new key without hashing gigabytes
  the machine        the CPU model and its instruction flags (machine_identity), and where it matters the thread
                     count
  the software       leaplm's version and, for what another library builds (a tokenizer), that library's version;
                     for a measurement, a hash of the source of the code that measures it (code_identity), so an
                     entry measured by other code (a calibration whose loop or cost model has changed) is not read

An entry that does not parse is treated as missing. LEAPLM_RECALIBRATE=1 (`--recalibrate`) ignores every entry
for the life of the process and writes fresh ones; LEAPLM_NO_STARTUP_CACHE=1 neither reads nor writes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

VERSION = "0.1.0"                 # leaplm's version (leaplm.__version__ reads the same); part of every key
EDGE_BYTES = 1 << 20              # bytes hashed at each end of a model file


def cache_root() -> Path:
    """$LEAPLM_CACHE/startup, else ~/.cache/leaplm/startup."""
    env = os.environ.get("LEAPLM_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "leaplm") / "startup"


def disabled() -> bool:
    return os.environ.get("LEAPLM_NO_STARTUP_CACHE") == "1"


def recalibrating() -> bool:
    """True when entries must be measured again (--recalibrate sets LEAPLM_RECALIBRATE=1 for the process)."""
    return os.environ.get("LEAPLM_RECALIBRATE") == "1"


def set_recalibrate(on: bool = True) -> None:
    """--recalibrate: every start-up check of this process measures again and replaces its entry."""
    if on:
        os.environ["LEAPLM_RECALIBRATE"] = "1"
    else:
        os.environ.pop("LEAPLM_RECALIBRATE", None)


def file_identity(path: str | os.PathLike) -> str:
    """A short hash of a file's size, modification time and first and last MiB."""
    p = Path(path)
    st = p.stat()
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(p, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        if st.st_size > 2 * EDGE_BYTES:
            f.seek(-EDGE_BYTES, os.SEEK_END)
            h.update(f.read(EDGE_BYTES))
    return h.hexdigest()[:20]


def dir_identity(path: str | os.PathLike) -> str:
    """file_identity over a checkpoint directory's files (names, sizes, times; the first MiB of each)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(file_identity(f).encode())
    return h.hexdigest()[:20]


def model_identity(path: str | os.PathLike) -> str:
    p = Path(path)
    return dir_identity(p) if p.is_dir() else file_identity(p)


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, str]:
    model, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = v.strip()
                elif k in ("flags", "Features") and not flags:
                    flags = v.strip()
                if model and flags and k == "":
                    break
    except OSError:
        pass
    return model, flags


def machine_identity() -> str:
    """The CPU model and a hash of its flags, e.g. 'AMD EPYC/3f2a…': what a SIMD choice or a timing depends on."""
    model, flags = _cpuinfo()
    return f"{model}/{hashlib.sha256(flags.encode()).hexdigest()[:12]}/{platform.machine()}"


@lru_cache(maxsize=None)
def code_identity(*paths: str) -> str:
    """A short hash of these source files' bytes (a measurement's code: its entry is keyed by it, so a changed
    measuring loop or cost model measures again instead of reading what the old code measured)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).name.encode())
        try:
            h.update(Path(p).read_bytes())
        except OSError:
            h.update(b"unreadable")
    return h.hexdigest()[:16]


def key(*parts: object) -> str:
    """The hash of `parts` (with leaplm's version and the machine): an entry's directory name."""
    return hashlib.sha256(json.dumps([VERSION, machine_identity(), *map(str, parts)]).encode()).hexdigest()[:24]


def entry_dir(kind: str, k: str) -> Path:
    return cache_root() / kind / k


def read_json(kind: str, k: str) -> dict | None:
    """The entry's JSON, or None when absent, unreadable, disabled or while recalibrating."""
    if disabled() or recalibrating():
        return None
    p = entry_dir(kind, k) / "entry.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def write_json(kind: str, k: str, value: dict) -> None:
    """Write an entry atomically (a temporary file renamed over it); an unwritable cache only logs."""
    if disabled():
        return
    d = entry_dir(kind, k)
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".entry")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, d / "entry.json")
    except OSError as e:
        log.info("start-up cache: cannot write %s (%s)", d, e)


def clear(kind: str | None = None) -> None:
    """Remove every entry (of `kind`)."""
    import shutil

    shutil.rmtree(cache_root() / kind if kind else cache_root(), ignore_errors=True)

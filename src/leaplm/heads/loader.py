"""Finding and loading a head for a target: an explicit directory (leaplm's layout, or the Speculators and
EAGLE layouts via heads/formats.py), else the head shipped in the package for that target (matched by the
target's weights' hash). A head for another target, or a damaged one, is refused naming what is wrong."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError
from ..models.embedded import EMBEDDED_DIR
from .checkpoint import FORMAT, check_target, identity_of
from .runtime import build_runtime


def shipped_heads(kind: str | None = None) -> dict[str, Path]:
    """Head directories shipped in the package, by name (optionally only one kind)."""
    out = {}
    if EMBEDDED_DIR.is_dir():
        for p in sorted(EMBEDDED_DIR.iterdir()):
            cfg = p / "config.json"
            if cfg.exists():
                meta = json.loads(cfg.read_text())
                if meta.get("format") == FORMAT and (kind is None or meta.get("kind") == kind):
                    out[p.name] = p
    return out


def default_head_dir(target, kind: str) -> Path | None:
    """The shipped head of `kind` trained for this very target, or None."""
    have = identity_of(target)
    for p in shipped_heads(kind).values():
        meta = json.loads((p / "config.json").read_text())
        if meta.get("target", {}).get("weights_sha256") == have.weights_sha256:
            return p
    return None


def head_dir(head: str) -> Path:
    """The directory of head `head`: a path, else the name of a shipped head (`eagle-smollm2`). A local path of
    that name wins; anything else is refused listing the shipped heads."""
    d = Path(head).expanduser()
    try:
        if d.exists():
            return d
    except (OSError, ValueError):             # a name no file can have (too long, a NUL): not a path
        pass
    shipped = shipped_heads()
    if head in shipped:
        return shipped[head]
    raise ConfigError("head", f"{head!r} is neither a head directory nor a shipped head "
                              f"({', '.join(shipped) or 'none ship'})")


def load_head_for(head: str | None, target, kind: str = "eagle"):
    """The runtime head (heads/runtime.py: EagleHead or MedusaHeads) for `target`."""
    if head is None:
        d = default_head_dir(target, kind)
        if d is None:
            raise ConfigError("head", f"no {kind} head ships for {target.name}; pass --head DIR "
                                      f"(train one with `leaplm train {kind}`)")
    else:
        d = head_dir(head)
    from .formats import read_any

    hf = read_any(d, target)
    if hf.kind != kind:
        raise ConfigError("head", f"{d} holds a {hf.kind} head, not {kind}")
    check_target(d, hf.target, identity_of(target))
    return build_runtime(hf, target, d)

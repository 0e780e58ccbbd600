"""The embedded model family that ships inside the package (trained by `leaplm train`, see its model cards)."""
from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "embedded"
TARGET = "target"
DRAFTS = ("draft-1m", "draft-3m")   # best first (measured acceptance, see their model cards)
BEST_DRAFT = DRAFTS[0]


def embedded_path(name: str) -> Path:
    return EMBEDDED_DIR / name


def available() -> dict[str, Path]:
    """Embedded checkpoints present on disk, by name."""
    return {p.name: p for p in sorted(EMBEDDED_DIR.iterdir()) if (p / "config.json").exists()} \
        if EMBEDDED_DIR.is_dir() else {}


def shipped_drafts() -> dict[str, Path]:
    """The drafts shipped in the package, by name (what `--draft NAME` accepts): every embedded causal LM but the
    default target. Heads are not drafts: they have their own format (heads/loader.shipped_heads lists them)."""
    import json

    return {name: path for name, path in available().items()
            if name != TARGET and "architectures" in json.loads((path / "config.json").read_text())}


def default_target() -> str:
    p = embedded_path(TARGET)
    if not (p / "config.json").exists():
        from ..config import ConfigError

        raise ConfigError("model", f"no --model given and the embedded default is missing at {p}")
    return str(p)


def default_draft() -> str | None:
    p = embedded_path(BEST_DRAFT)
    return str(p) if (p / "config.json").exists() else None


def draft_for(tokenizer) -> str | None:
    """The embedded draft trained for a target with this tokenizer (matched by the vocabulary's fingerprint
    recorded in the draft's config.json, not by path), or None."""
    import json

    from .draft_vocab import tokenizer_fingerprint

    want = None
    for name, path in available().items():
        meta = json.loads((path / "config.json").read_text()).get("leaplm_draft")
        if not meta:
            continue
        want = want or tokenizer_fingerprint(tokenizer)
        if meta.get("tokenizer_sha256") == want:
            return str(path)
    return None

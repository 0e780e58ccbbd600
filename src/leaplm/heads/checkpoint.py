"""leaplm's own head checkpoint: config.json (the head's shape + the target it was trained for) and
model.safetensors. Loading checks the target: a head read another model's features is useless, so any mismatch
(hidden size, vocabulary, layer count, the target's weights' hash) is refused naming what differs."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config import ConfigError

FORMAT = "leaplm-eagle-head"


@dataclass
class TargetIdentity:
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    weights_sha256: str              # of the target's weight files (safetensors shards, or the GGUF file)

    def differences(self, other: "TargetIdentity") -> list[str]:
        return [f"{k}: head was trained for {a}, target has {b}" for k, a, b in
                ((k, getattr(self, k), getattr(other, k)) for k in asdict(self)) if a != b]


_HASHES: dict[tuple, str] = {}


def weights_sha256(path: str | Path) -> str:
    """sha256 over a checkpoint's weight files (sorted *.safetensors, or the .gguf file itself); memoised per
    (file, size, mtime) so loading a head twice hashes once."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _HASHES:
        h = hashlib.sha256()
        for f in files:
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def identity_of(loaded) -> TargetIdentity:
    """The identity of a loaded target (models.base.LoadedModel)."""
    a = loaded.model.args
    return TargetIdentity(a.hidden_size, a.vocab_size, a.num_hidden_layers, weights_sha256(loaded.path))


def check_target(head_dir: str | Path, want: TargetIdentity, have: TargetIdentity, field: str = "head") -> None:
    diff = want.differences(have)
    if diff:
        raise ConfigError(field, f"{head_dir} was trained for another target: " + "; ".join(diff))


def save_head(out_dir: str | Path, kind: str, config: dict, target: TargetIdentity,
              state: dict[str, torch.Tensor], extra: dict | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "kind": kind, "head": config, "target": asdict(target), **(extra or {})}
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


@dataclass
class HeadFile:
    kind: str                          # "eagle" or "medusa"
    config: dict
    target: TargetIdentity
    state: dict[str, torch.Tensor]
    meta: dict


def read_head(head_dir: str | Path, field: str = "head") -> HeadFile:
    """Read a leaplm head directory; a missing, truncated or foreign file is refused naming `field`."""
    d = Path(head_dir)
    cfg_path, w_path = d / "config.json", d / "model.safetensors"
    if not cfg_path.exists() or not w_path.exists():
        raise ConfigError(field, f"{d} is not a head checkpoint (needs config.json and model.safetensors)")
    try:
        meta = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(field, f"{cfg_path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if meta.get("format") != FORMAT:
        raise ConfigError(field, f"{cfg_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    try:
        from safetensors.torch import load_file

        state = load_file(str(w_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise ConfigError(field, f"{w_path} is corrupt or truncated ({type(e).__name__}: {e})") from None
    try:
        target = TargetIdentity(**meta["target"])
    except (KeyError, TypeError) as e:
        raise ConfigError(field, f"{cfg_path}: 'target' is missing or malformed ({e})") from None
    return HeadFile(meta.get("kind", "eagle"), meta["head"], target, state, meta)

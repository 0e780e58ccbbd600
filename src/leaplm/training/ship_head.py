"""Shipping a trained head in the package (src/leaplm/embedded/<name>): weights stored in bfloat16 (the maps of
a draft vocabulary stay integers; loading computes in fp32), the run's log and config kept for the card, and
the card (training/head_card.py) rewritten with the measured acceptance and the training command."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..heads.checkpoint import read_head
from .head_card import write_head_card


def ship_head(run_dir: str | Path, out_dir: str | Path, acceptance: list[dict] | None = None,
              command: str | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    src, out = Path(run_dir), Path(out_dir)
    hf = read_head(src, field="head")
    for f in ("train_log.jsonl", "train_config.json"):
        if not (src / f).exists():
            raise FileNotFoundError(f"head: {src} has no {f} (not a `leaplm train eagle/medusa` output)")
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in hf.state.items()}
    save_file(state, str(out / "model.safetensors"))
    meta = dict(hf.meta)
    meta["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    for f in ("train_log.jsonl", "train_config.json"):
        shutil.copyfile(src / f, out / f)
    write_head_card(out, acceptance, command)
    return out

"""The training corpus: Python source files, by default the standard library's, with whole modules held out.

Held-out modules are never trained on; evaluation (perplexity, acceptance) reads prompts only from them.
"""
from __future__ import annotations

import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

# Whole packages kept out of training, used for evaluation and benchmark prompts.
HELD_OUT_MODULES = ("asyncio", "email", "json")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_of(path: Path, root: Path) -> str:
    return path.relative_to(root).parts[0]


def stdlib_files(split: str = "train") -> list[Path]:
    """Python files of the standard library (site-packages excluded), sorted for reproducibility.

    split: "train" (everything but HELD_OUT_MODULES) or "heldout" (only those).
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_dir()
    out = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if "site-packages" in parts or "__pycache__" in parts:
            continue
        held = _module_of(p, root) in HELD_OUT_MODULES
        if held == (split == "heldout"):
            out.append(p)
    return out


def corpus_texts(corpus: str, split: str = "train", max_files: int | None = None) -> list[str]:
    """Texts of a corpus: 'stdlib', a directory of .py files, or a .jsonl file with a 'text' field per line."""
    if corpus == "stdlib":
        files = stdlib_files(split)
        texts = [_read(p) for p in files[:max_files]]
    else:
        path = Path(corpus)
        if not path.exists():
            raise FileNotFoundError(f"corpus: {corpus!r} is neither 'stdlib' nor an existing path")
        if path.is_dir():
            texts = [_read(p) for p in sorted(path.rglob("*.py"))[:max_files]]
        elif path.suffix == ".jsonl":
            texts = []
            with path.open() as f:
                for line in f:
                    if line.strip():
                        texts.append(json.loads(line)["text"])
            texts = texts[:max_files]
        else:
            texts = [_read(path)]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"corpus: {corpus!r} ({split}) contains no text")
    return texts


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


@dataclass
class TokenStream:
    """All documents tokenized and joined with EOS, sampled as random fixed-length windows."""

    ids: torch.Tensor  # [n_tokens] int32

    @classmethod
    def build(cls, texts: list[str], tokenizer, eos_id: int) -> "TokenStream":
        enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
        flat: list[int] = []
        for ids in enc:
            flat.extend(ids)
            flat.append(eos_id)
        return cls(torch.tensor(flat, dtype=torch.int32))

    def __len__(self) -> int:
        return self.ids.numel()

    def batch(self, rng: random.Random, batch_size: int, seq_len: int) -> torch.Tensor:
        """Random windows: [batch_size, seq_len] int64."""
        hi = len(self) - seq_len - 1
        if hi <= 0:
            raise ValueError(f"corpus has {len(self)} tokens, fewer than seq_len={seq_len}")
        starts = [rng.randrange(hi) for _ in range(batch_size)]
        return torch.stack([self.ids[s : s + seq_len] for s in starts]).long()


_DEF = re.compile(r"^( *)(async )?def \w+\(")


def functions(split: str = "heldout", min_lines: int = 8, max_lines: int = 40,
              max_files: int | None = None) -> list[tuple[list[str], int, int]]:
    """(file lines, start, end) of functions and methods in a stdlib split's files, in a fixed order.

    Benchmarks read the held-out split; on-policy distillation data reads the training split."""
    found = []
    for path in stdlib_files(split)[:max_files]:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        for i, line in enumerate(lines):
            m = _DEF.match(line)
            if not m:
                continue
            ind = len(m.group(1))
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip(" ")) > ind):
                j += 1
            while j > i and not lines[j - 1].strip():
                j -= 1
            if min_lines <= j - i <= max_lines:
                found.append((lines, i, j))
    return found

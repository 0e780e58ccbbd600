"""Benchmark prompt sets, cut deterministically from held-out standard-library modules (never trained on).

- code: the context before a function definition plus its `def` line; the model writes the body (free-form).
- copy: a whole function followed by the start of a second copy of it; the continuation repeats text that
  is already in the prompt (what prompt lookup and suffix caches exploit).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..training.corpus import stdlib_files

WORKLOADS = ("code", "copy")
_DEF = re.compile(r"^( *)(async )?def \w+\(")


@dataclass
class Workload:
    name: str
    description: str
    prompts: list[str]


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


def _spread(items: list, n: int) -> list:
    """n items spread evenly over the list (deterministic, covers many files)."""
    if n >= len(items):
        return items
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def code_workload(n: int = 8, context_lines: int = 30, max_chars: int = 1200) -> Workload:
    prompts = []
    for lines, i, _ in _spread(functions(), n):
        text = "".join(lines[max(0, i - context_lines) : i + 1])
        prompts.append(text[-max_chars:])
    return Workload("code", "continue held-out stdlib code after a def line", prompts)


def copy_workload(n: int = 8, max_chars: int = 1400, lead_lines: int = 2) -> Workload:
    prompts = []
    for lines, i, j in _spread(functions(), n):
        fn = "".join(lines[i:j])
        if len(fn) > max_chars:
            fn = fn[:max_chars].rsplit("\n", 1)[0] + "\n"
        lead = "".join(fn.splitlines(keepends=True)[:lead_lines])
        prompts.append(fn + "\n\n" + lead)
    return Workload("copy", "a held-out function, then the start of a second copy of it", prompts)


def fit_to_context(w: Workload, tokenizer, max_prompt_tokens: int) -> Workload:
    """Cut prompts from the left (at line starts where possible) until they fit the model's context."""
    fitted = []
    for p in w.prompts:
        while len(tokenizer(p, add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
            cut = p.find("\n", max(1, len(p) // 8))
            p = p[cut + 1 :] if 0 <= cut < len(p) - 1 else p[len(p) // 8 :]
        fitted.append(p)
    return Workload(w.name, w.description, fitted)


def get_workload(name: str, n: int) -> Workload:
    if name == "code":
        return code_workload(n)
    if name == "copy":
        return copy_workload(n)
    from ..config import ConfigError

    raise ConfigError("workload", f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")

"""Continuation prompts for a base (completion) model, derived from the standard library's training split.

Two kinds, as a base model is used: code (up to 30 lines of a module ending with a function's `def` line, the
model writes the body) and prose (the first sentences of a long docstring, the model writes on). They mirror
the benchmark's code workload and its prose docstrings, read from the other split: the held-out modules
(corpus.HELD_OUT_MODULES) are never read, so benchmark prompts stay unseen.
"""
from __future__ import annotations

import ast
import random

from .corpus import functions, stdlib_files

KINDS = ("code", "prose")


def _prose(max_files: int | None, min_chars: int = 400, max_chars: int = 3000) -> list[str]:
    """The leading half (cut after a sentence) of each long docstring of the training split."""
    out = []
    for path in stdlib_files("train")[:max_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in [tree] + [x for x in ast.walk(tree) if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                            ast.ClassDef))]:
            doc = ast.get_docstring(node)
            if not doc or not min_chars <= len(doc) <= max_chars:
                continue
            cut = doc.find(". ", len(doc) // 3)
            if 0 < cut < len(doc) * 3 // 4:
                out.append(doc[: cut + 1])
    return out


def continuation_prompts(seed: int = 0, max_files: int | None = None, context_lines: int = 30,
                         max_chars: int = 1200) -> list[str]:
    """Every prompt derivable from the training split, in a seeded order alternating code and prose."""
    rng = random.Random(seed)
    code = ["".join(lines[max(0, i - context_lines) : i + 1])[-max_chars:]
            for lines, i, _ in functions("train", max_files=max_files)]
    prose = _prose(max_files)
    rng.shuffle(code)
    rng.shuffle(prose)
    out = []
    for i in range(max(len(code), len(prose))):    # any prefix holds both kinds in equal shares
        out += [k[i] for k in (code, prose) if i < len(k)]
    return out

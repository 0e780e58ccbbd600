"""Chat prompts that leaplm writes itself, derived from the standard library (training split only).

Three kinds, as users ask a small chat model: code requests ("Write a Python function that ..." from a
function's docstring and signature), code edits (a function's source with an instruction) and plain questions
(about modules and functions, plus a fixed list written here). The held-out modules (corpus.HELD_OUT_MODULES)
are never read, so the benchmark's chat prompts stay unseen.
"""
from __future__ import annotations

import ast
import random
from dataclasses import dataclass

from .corpus import stdlib_dir, stdlib_files

KINDS = ("code", "edit", "question")

EDITS = (
    "Add type hints to this function.",
    "Add a docstring to this function.",
    "Rewrite this function so that it is easier to read.",
    "Explain what this function does, step by step.",
    "Write a unit test for this function.",
    "Rename the variables of this function to clearer names.",
    "Is there a bug in this function? Fix it if there is one.",
    "Make this function shorter without changing what it does.",
)

QUESTIONS = (
    "What is the difference between a list and a tuple in Python?",
    "How do I read a file line by line in Python?",
    "What is a decorator in Python?",
    "Explain recursion with a simple example.",
    "What does the `yield` keyword do?",
    "How do I sort a dictionary by its values?",
    "What is the difference between `==` and `is`?",
    "How do I handle exceptions in Python?",
    "What is a virtual environment and why should I use one?",
    "Explain list comprehensions.",
    "What is the capital of France?",
    "Why is the sky blue?",
    "How many days are there in a leap year?",
    "What is photosynthesis?",
    "Give me three tips for writing clean code.",
    "What is the time complexity of binary search?",
    "Explain what an API is to a beginner.",
    "What is the difference between a process and a thread?",
    "How does a hash table work?",
    "What is version control and why is it useful?",
    "Summarize the rules of chess in a few sentences.",
    "What are the primary colors?",
    "How do vaccines work?",
    "Write a short poem about the sea.",
    "What is machine learning?",
    "Explain the difference between RAM and storage.",
    "How do I reverse a list in Python?",
    "What is the difference between `append` and `extend`?",
    "How do I merge two dictionaries?",
    "What is a lambda function?",
)

MODULE_QUESTIONS = (
    "What is the Python `{m}` module used for?",
    "Give an example of using the `{m}` module in Python.",
)
FUNC_QUESTIONS = (
    "How do I use `{f}` in Python?",
    "What does `{f}` return?",
)


@dataclass
class ChatPrompt:
    kind: str          # one of KINDS
    text: str          # the user message (the chat template is applied by the caller)


def _first_sentence(doc: str) -> str:
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    s = line.split(". ")[0].rstrip(".")
    return s[:1].lower() + s[1:] if s else ""


def _signature(node: ast.FunctionDef) -> str:
    args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
    return f"{node.name}({', '.join(args)})"


def _module_name(path, root) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def chat_prompts(seed: int = 0, max_files: int | None = None, max_edit_lines: int = 25) -> list[ChatPrompt]:
    """Every prompt derivable from the training split, in a seeded order that interleaves the three kinds."""
    root = stdlib_dir()
    rng = random.Random(seed)
    by_kind: dict[str, list[ChatPrompt]] = {k: [] for k in KINDS}
    by_kind["question"] += [ChatPrompt("question", q) for q in QUESTIONS]
    for path in stdlib_files("train")[:max_files]:
        if "test" in path.parts or path.name.startswith("test_"):
            continue                                  # test suites: long, repetitive, few docstrings
        src = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            continue
        lines = src.splitlines()
        mod = _module_name(path, root)
        if ast.get_docstring(tree) and not mod.startswith("_"):
            by_kind["question"].append(ChatPrompt("question", rng.choice(MODULE_QUESTIONS).format(m=mod)))
        top = {id(n) for n in tree.body}              # module-level functions: `mod.name` is what users call
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if doc and len(_first_sentence(doc)) > 15:
                by_kind["code"].append(ChatPrompt(
                    "code", f"Write a Python function `{_signature(node)}` that {_first_sentence(doc)}."))
                if id(node) in top and rng.random() < 0.3:
                    by_kind["question"].append(ChatPrompt(
                        "question", rng.choice(FUNC_QUESTIONS).format(f=f"{mod}.{node.name}")))
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if 4 <= n <= max_edit_lines:
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                indent = len(body) - len(body.lstrip(" "))
                body = "\n".join(ln[indent:] for ln in body.splitlines())
                by_kind["edit"].append(ChatPrompt("edit", f"{rng.choice(EDITS)}\n\n```python\n{body}\n```"))
    for v in by_kind.values():
        rng.shuffle(v)
    out: list[ChatPrompt] = []
    # interleave code, edit, question so any prefix of the list has all three kinds in equal shares
    for i in range(max(len(v) for v in by_kind.values())):
        for k in KINDS:
            if i < len(by_kind[k]):
                out.append(by_kind[k][i])
    return out

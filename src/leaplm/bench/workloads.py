"""Benchmark prompt sets, cut deterministically from held-out standard-library modules (never trained on).

- code: the context before a function definition plus its `def` line; the model writes the body (free-form).
- copy: a whole function followed by the start of a second copy of it; the continuation repeats text that
  is already in the prompt (what prompt lookup and suffix caches exploit).
- chat-code, chat-edit, chat-question: user messages for chat models (applied through the target's chat
  template by the caller): "Write a Python function ..." from held-out docstrings, a held-out function with an
  edit instruction, plain questions written here (none of them among training/chat_prompts.py's).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import StructuredOutput
from ..training.corpus import functions

WORKLOADS = ("code", "copy", "chat-code", "chat-edit", "chat-question")
CHAT_WORKLOADS = ("chat-code", "chat-edit", "chat-question")
STRUCTURED_WORKLOADS = ("json-extract", "tool-call")       # each prompt with a JSON Schema: bench/structured.py


@dataclass
class Workload:
    name: str
    description: str
    prompts: list[str]
    chat: bool = False              # prompts are user messages: apply the target's chat template (as_chat)
    constraints: list[StructuredOutput] | None = None   # per prompt: what a `+schema` configuration constrains


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


HELDOUT_QUESTIONS = (
    "What is the difference between a shallow copy and a deep copy in Python?",
    "How do I check whether a string is a palindrome?",
    "Explain what a generator expression is.",
    "What is the boiling point of water at sea level?",
    "How do I count the words in a text file with Python?",
    "What does the `with` statement do in Python?",
    "Name three planets of the solar system.",
    "What is the difference between a set and a list?",
    "How can I measure how long a function takes to run?",
    "Explain what a closure is in programming.",
    "What is an HTTP status code 404?",
    "Give two reasons to write tests for your code.",
)


def _docstring_requests(n: int) -> list[str]:
    import ast

    out = []
    for lines, i, j in _spread(functions(min_lines=4, max_lines=60), n * 8):
        src = "".join(lines[i:j])
        indent = len(src) - len(src.lstrip(" "))
        try:
            node = ast.parse("\n".join(ln[indent:] for ln in src.splitlines())).body[0]
        except (SyntaxError, IndexError):
            continue
        doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        first = doc.strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".") if doc else ""
        if len(first) > 15 and not node.name.startswith("_"):
            args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
            out.append(f"Write a Python function `{node.name}({args})` that {first[0].lower() + first[1:]}.")
    return _spread(out, n)


def chat_workload(name: str, n: int = 8) -> Workload:
    if name == "chat-code":
        return Workload(name, "chat: write a function from a held-out docstring", _docstring_requests(n), chat=True)
    if name == "chat-edit":
        asks = ("Add type hints to this function.", "Explain what this function does.",
                "Rewrite this function so that it is easier to read.", "Add a docstring to this function.")
        prompts = []
        for idx, (lines, i, j) in enumerate(_spread(functions(min_lines=5, max_lines=20), n)):
            body = "".join(lines[i:j])
            indent = len(body) - len(body.lstrip(" "))
            body = "".join(ln[indent:] if ln.strip() else ln for ln in body.splitlines(keepends=True))
            prompts.append(f"{asks[idx % len(asks)]}\n\n```python\n{body.rstrip()}\n```")
        return Workload(name, "chat: edit or explain a held-out function", prompts, chat=True)
    return Workload(name, "chat: plain questions", _spread(list(HELDOUT_QUESTIONS), n), chat=True)


def as_chat(w: Workload, tokenizer, name: str = "model") -> Workload:
    """A chat workload's messages through the target's chat template (assistant turn opened)."""
    if not w.chat:
        return w
    from ..models.tokens import chat_prompt

    return Workload(w.name, w.description, [chat_prompt(tokenizer, p, name) for p in w.prompts], chat=False,
                    constraints=w.constraints)


def fit_to_context(w: Workload, tokenizer, max_prompt_tokens: int) -> Workload:
    """Cut prompts from the left (at line starts where possible) until they fit the model's context."""
    fitted = []
    for p in w.prompts:
        while len(tokenizer(p, add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
            cut = p.find("\n", max(1, len(p) // 8))
            p = p[cut + 1 :] if 0 <= cut < len(p) - 1 else p[len(p) // 8 :]
        fitted.append(p)
    return Workload(w.name, w.description, fitted, constraints=w.constraints)


def get_workload(name: str, n: int) -> Workload:
    if name == "code":
        return code_workload(n)
    if name == "copy":
        return copy_workload(n)
    if name in CHAT_WORKLOADS:
        return chat_workload(name, n)
    from ..config import ConfigError

    if name in STRUCTURED_WORKLOADS:
        raise ConfigError("workload", f"{name} is a structured workload: `leaplm bench` runs it")

    raise ConfigError("workload", f"unknown workload {name!r}; choose from "
                                  f"{', '.join(WORKLOADS + STRUCTURED_WORKLOADS)}")

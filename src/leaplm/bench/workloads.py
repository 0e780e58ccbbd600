"""Benchmark prompt sets, cut deterministically from held-out standard-library modules (never trained on).

- code: the context before a function definition plus its `def` line; the model writes the body (free-form).
- copy: a whole function followed by the start of a second copy of it; the continuation repeats text that
  is already in the prompt (what prompt lookup and suffix caches exploit).
- chat-code, chat-edit, chat-question: user messages for chat models (applied through the target's chat
  template by the caller): "Write a Python function ..." from held-out docstrings, a held-out function with an
  edit instruction, plain questions written here (none of them among training/chat_prompts.py's).
- edit, proofread, quote, agent: copy-heavy chat requests, each prompt with a prediction (Predicted Outputs: a
  configuration written `method+prediction` sends it): rename a parameter in a held-out function (the function
  as the prediction); correct the spelling of a held-out docstring with a few letters swapped (the text as
  given); quote the paragraph of a held-out docstring that mentions a word (the document); an agent-style
  conversation whose tool output (a held-out function) the answer prints again with a docstring (the tool
  output). complete: the same for a completion model: a held-out function with a few lines changed, then its
  `def` line again (the original function as the prediction).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import StructuredOutput
from ..training.corpus import functions

WORKLOADS = ("code", "copy", "chat-code", "chat-edit", "chat-question", "edit", "proofread", "quote", "agent",
             "complete")
CHAT_WORKLOADS = ("chat-code", "chat-edit", "chat-question")
PREDICTED_WORKLOADS = ("edit", "proofread", "quote", "agent", "complete")
STRUCTURED_WORKLOADS = ("json-extract", "tool-call")       # each prompt with a JSON Schema: bench/structured.py


@dataclass
class Workload:
    name: str
    description: str
    prompts: list[str]
    chat: bool = False              # prompts are user messages: apply the target's chat template (as_chat)
    constraints: list[StructuredOutput] | None = None   # per prompt: what a `+schema` configuration constrains
    predictions: list[str] | None = None    # per prompt: what a `+prediction` configuration sends as its prediction


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
                    constraints=w.constraints, predictions=w.predictions)


def fit_to_context(w: Workload, tokenizer, max_prompt_tokens: int) -> Workload:
    """Cut prompts from the left (at line starts where possible) until they fit the model's context."""
    fitted = []
    for p in w.prompts:
        while len(tokenizer(p, add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
            cut = p.find("\n", max(1, len(p) // 8))
            p = p[cut + 1 :] if 0 <= cut < len(p) - 1 else p[len(p) // 8 :]
        fitted.append(p)
    return Workload(w.name, w.description, fitted, constraints=w.constraints, predictions=w.predictions)


def get_workload(name: str, n: int) -> Workload:
    if name == "code":
        return code_workload(n)
    if name == "copy":
        return copy_workload(n)
    if name in CHAT_WORKLOADS:
        return chat_workload(name, n)
    if name in PREDICTED_WORKLOADS:
        return predicted_workload(name, n)
    from ..config import ConfigError

    if name in STRUCTURED_WORKLOADS:
        raise ConfigError("workload", f"{name} is a structured workload: `leaplm bench` runs it")

    raise ConfigError("workload", f"unknown workload {name!r}; choose from "
                                  f"{', '.join(WORKLOADS + STRUCTURED_WORKLOADS)}")


# --- copy-heavy workloads with a prediction -------------------------------------------------------------------------
def _dedent(lines: list[str]) -> str:
    body = "".join(lines)
    indent = len(body) - len(body.lstrip(" "))
    return "".join(ln[indent:] if ln.strip() else ln for ln in body.splitlines(keepends=True)).rstrip() + "\n"


def _parameter(src: str) -> str | None:
    """A parameter of the function in src used at least twice in its body (what an edit renames), else None."""
    import ast
    import re

    try:
        node = ast.parse(src).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for a in node.args.args:
        if a.arg not in ("self", "cls") and len(a.arg) >= 3 and len(re.findall(rf"\b{a.arg}\b", src)) >= 3:
            return a.arg
    return None


def _docstrings(n: int, min_chars: int = 400, max_chars: int = 1500) -> list[str]:
    """n prose docstrings (module, class or function) of the held-out modules, spread over them."""
    import ast

    from ..training.corpus import stdlib_files

    out = []
    for path in stdlib_files("heldout"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in [tree] + [x for x in ast.walk(tree) if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                            ast.ClassDef))]:
            doc = ast.get_docstring(node)
            if doc and min_chars <= len(doc) <= max_chars and doc.count("\n\n") >= 1:
                out.append(doc.strip() + "\n")
    return _spread(out, n)


def _typos(text: str, every: int = 9) -> str:
    """Every `every`-th word of 5+ letters with two inner letters swapped (deterministic)."""
    import re

    count = 0

    def swap(m):
        nonlocal count
        w = m.group(0)
        count += 1
        if count % every or len(w) < 5:
            return w
        i = len(w) // 2
        return w[: i - 1] + w[i] + w[i - 1] + w[i + 1:] if w[i] != w[i - 1] else w

    return re.sub(r"[A-Za-z]{5,}", swap, text)


def _changed(src: str, every: int = 5) -> str:
    """src with every `every`-th non-blank line of its body changed: a comment appended."""
    lines = src.splitlines(keepends=True)
    out, k = [], 0
    for i, ln in enumerate(lines):
        if i and ln.strip() and not ln.strip().startswith(("#", '"', "'")):
            k += 1
            if k % every == 0:
                ln = ln.rstrip("\n") + "  # changed\n"
        out.append(ln)
    return "".join(out)


def predicted_workload(name: str, n: int = 8) -> Workload:
    prompts: list = []
    preds: list[str] = []
    if name in ("edit", "agent", "complete"):
        found = []
        for lines, i, j in functions(min_lines=8, max_lines=30):
            src = _dedent(lines[i:j])
            param = _parameter(src)
            if param is not None:
                found.append((src, param))
        for src, param in _spread(found, n):
            fenced = f"```python\n{src}```"
            if name == "edit":
                prompts.append(f"Rename the parameter `{param}` to `{param}_value` in this function. Reply with the "
                               f"whole updated function only.\n\n{fenced}")
                preds.append(fenced + "\n")
            elif name == "agent":
                fname = src.split("def ", 1)[1].split("(", 1)[0]
                prompts.append([
                    {"role": "user", "content": f"Find the function `{fname}` in the project and show it to me."},
                    {"role": "assistant", "content": f'read_function("{fname}")'},
                    {"role": "user", "content": f"Tool output:\n{fenced}"},
                    {"role": "assistant", "content": f"This is `{fname}`; it takes `{param}` among its arguments."},
                    {"role": "user", "content": "Print the whole function again, exactly as the tool returned it."}])
                preds.append(fenced + "\n")
            else:
                head = src.splitlines(keepends=True)[0]
                prompts.append(f"# an earlier version:\n{_changed(src)}\n\n# the current version:\n{head}")
                preds.append(src[len(head):])
    else:
        for doc in _docstrings(n):
            if name == "proofread":
                text = _typos(doc)
                prompts.append(f"Correct the spelling mistakes in this text. Reply with the corrected text only."
                               f"\n\n{text}")
                preds.append(text)
            else:
                paras = [p for p in doc.split("\n\n") if p.strip()]
                para = max(paras, key=len)
                word = max((w.strip(".,:;()`'\"") for w in para.split()), key=len)
                prompts.append(f"{doc}\nQuote, word for word, the paragraph of the text above that mentions "
                               f"`{word}`.")
                preds.append(doc)
    desc = {"edit": "chat: rename a parameter in a held-out function (prediction: the function)",
            "proofread": "chat: correct a held-out docstring's swapped letters (prediction: the text as given)",
            "quote": "chat: quote the paragraph of a held-out docstring that mentions a word (prediction: it all)",
            "agent": "chat: print again a held-out function a tool returned (prediction: the tool output)",
            "complete": "a held-out function with a few lines changed, then its def line again (prediction: the "
                        "original)"}[name]
    return Workload(name, desc, prompts, chat=name != "complete", predictions=preds)

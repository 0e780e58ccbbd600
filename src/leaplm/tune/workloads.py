"""Prompt sets for `leaplm tune`: the benchmark's code and copy, plus chat, noise and a user's own file.

- chat: short conversational requests, written here (free-form prose answers: the hardest case for drafts
  trained on code, a realistic one for instruction-tuned targets).
- noise: random printable characters (a deterministic seed): high-entropy text where neither a draft nor a
  lookup cache can guess the continuation; with sampling, the workload on which speculation should not pay.
- FILE: a text file of prompts separated by blank lines, or a .jsonl file of {"prompt": ...} objects.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

from ..bench.workloads import Workload, get_workload
from ..config import ConfigError

TUNE_WORKLOADS = ("code", "copy", "chat", "noise")

CHAT = [
    "User: How do I read a file line by line in Python?\nAssistant:",
    "User: Explain what a hash table is in two sentences.\nAssistant:",
    "User: Write a function that reverses a string.\nAssistant:",
    "User: What is the difference between a list and a tuple?\nAssistant:",
    "User: Summarise what speculative decoding does.\nAssistant:",
    "User: How can I sort a dictionary by its values?\nAssistant:",
    "User: Give me three tips for writing readable code.\nAssistant:",
    "User: What does the `with` statement do?\nAssistant:",
]


def noise_workload(n: int, chars: int = 200, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " "
    prompts = ["".join(rng.choice(alphabet) for _ in range(chars)) for _ in range(n)]
    return Workload("noise", "random printable characters (high entropy)", prompts)


def file_workload(path: Path, n: int) -> Workload:
    if not path.is_file():
        raise ConfigError("workload", f"no such file: {str(path)!r} (or choose one of {', '.join(TUNE_WORKLOADS)})")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        prompts = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError("workload", f"{path}:{i + 1}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ConfigError("workload", f"{path}:{i + 1}: expected an object with a string 'prompt'")
            prompts.append(obj["prompt"])
    else:
        prompts = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
    if not prompts:
        raise ConfigError("workload", f"{path} holds no prompts")
    return Workload(path.stem, f"prompts from {path}", prompts[:n])


def tune_workload(name: str, n: int) -> Workload:
    if name in ("code", "copy"):
        return get_workload(name, n)
    if name == "chat":
        return Workload("chat", "short conversational requests", CHAT[:n] if n <= len(CHAT) else
                        [CHAT[i % len(CHAT)] for i in range(n)])
    if name == "noise":
        return noise_workload(n)
    return file_workload(Path(name), n)

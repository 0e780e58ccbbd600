"""The shape of the code that keeps the step readable and the model contract explicit, read from the source:
engine/step.py stays under 300 lines, nothing in engine/ or propose/ probes an object with getattr/hasattr (models
declare what they can do in ModelCapabilities, models/base.py), and each model class's declared capabilities match
the methods it has."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "leaplm"
STEP_MAX_LINES = 300
PROBES = ("getattr", "hasattr")
# (module, the probed expression): reads that are not about a model
ALLOWED = {
    ("engine/stats.py", "self"), ("engine/stats.py", "other"),        # a dataclass's own fields, by name
    ("engine/detok.py", "tokenizer"), ("propose/prediction.py", "tokenizer"),   # the Rust tokenizer behind a fast one
    ("engine/startup_checks.py", "q"),                               # a quantized weight's kernel, for a cache key
}


def probes(source: str) -> list[tuple[int, str]]:
    """(line, probed expression) of every getattr/hasattr call in source."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES and node.args:
            out.append((node.lineno, ast.unparse(node.args[0])))
    return out


def test_the_step_module_stays_under_300_lines():
    n = len((SRC / "engine" / "step.py").read_text().splitlines())
    assert n < STEP_MAX_LINES, f"engine/step.py has {n} lines: the stages belong in their own modules"


def test_the_probe_finder_sees_a_probe():
    """The negative control: a probed model is found, whichever way it is written."""
    src = "def f(m):\n    if hasattr(m.model, 'forward_hidden'):\n        return getattr(m, 'ragged', False)\n"
    assert sorted(probes(src)) == [(2, "m.model"), (3, "m")]


@pytest.mark.parametrize("package", ["engine", "propose"])
def test_no_getattr_probing_in_the_engine_and_proposers(package):
    found = []
    for path in sorted((SRC / package).rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        found += [f"{rel}:{line}: {what}" for line, what in probes(path.read_text()) if (rel, what) not in ALLOWED]
    assert not found, "read model.capabilities (models/base.py) instead of probing:\n" + "\n".join(found)


def test_model_classes_declare_what_they_have():
    from leaplm.models.base import ModelCapabilities
    from leaplm.models.hf import HFCausalLM
    from leaplm.models.llama import LlamaForCausalLM
    from leaplm.models.llamacpp.model import LlamaCppLM

    for cls in (LlamaForCausalLM, LlamaCppLM, HFCausalLM):
        caps = cls.capabilities
        assert isinstance(caps, ModelCapabilities), cls.__name__
        assert caps.hidden_states == hasattr(cls, "forward_hidden"), cls.__name__

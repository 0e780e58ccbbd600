"""The shape of the code that keeps the step readable and the model contract explicit, read from the source:
engine/step.py stays under 300 lines, nothing in engine/ or propose/ probes an object with getattr/hasattr (models
declare what they can do in ModelCapabilities, models/base.py), each model class's declared capabilities match
the methods it has, the trainers share one loop (training/loop.py), and no source file, the C++ kernel's included,
is longer than 600 lines, and each model family is one description (models/arch/) that the loaders read
instead of branching on the family's name."""
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


# the trainers: draft pretraining, draft distillation, chat-draft distillation, EAGLE and Medusa heads (eagle.py,
# kind "medusa")
TRAINERS = ("training/pretrain.py", "training/distill.py", "training/chat_distill.py", "training/eagle.py")
# what only the loop does: the optimizer's steps, gradients, clipping, the learning-rate schedule
LOOP_ONLY = {"backward", "zero_grad", "clip_grad_norm_", "clip_grad_value_", "param_groups", "LambdaLR",
             "CosineAnnealingLR", "AdamW", "Adam", "SGD", "lr_at", "_lr"}


def loop_work(source: str) -> list[tuple[int, str]]:
    """(line, name) of every use of LOOP_ONLY names: calls, attributes and function definitions."""
    out = []
    for node in ast.walk(ast.parse(source)):
        name = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                else node.name if isinstance(node, ast.FunctionDef) else None)
        if name in LOOP_ONLY:
            out.append((node.lineno, name))
    return out


def test_the_loop_finder_sees_a_hand_written_loop():
    """The negative control: a trainer's own optimizer step and schedule are found."""
    src = ("def lr_at(i):\n    return 1\n"
           "def train(m, opt):\n    opt.zero_grad()\n    m.loss().backward()\n    torch.optim.AdamW(m.parameters())\n")
    assert sorted(loop_work(src)) == [(1, "lr_at"), (4, "zero_grad"), (5, "backward"), (6, "AdamW")]


def test_the_trainers_share_one_loop():
    calls_trainer = lambda src: any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Trainer"
                                    for n in ast.walk(ast.parse(src)))
    for rel in TRAINERS:
        assert calls_trainer((SRC / rel).read_text()), f"{rel} does not run training/loop.py's Trainer"
    found = []
    for path in sorted((SRC / "training").glob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel != "training/loop.py":
            found += [f"{rel}:{line}: {name}" for line, name in loop_work(path.read_text())]
    assert not found, "optimizer steps and schedules belong to training/loop.py:\n" + "\n".join(found)


# one file, one job: a source file past this many lines holds several jobs that belong in files of their own
MAX_SOURCE_LINES = 600
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".inc")


def oversized(root: Path, limit: int) -> list[str]:
    """'path: lines' of every source file under root longer than limit lines."""
    out = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        n = len(path.read_text(errors="replace").splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root).as_posix()}: {n}")
    return out


def test_the_size_finder_sees_a_long_file(tmp_path):
    """The negative control: a file one line past the limit is found, one at the limit is not."""
    (tmp_path / "long.cpp").write_text("x\n" * 11)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ok.py").write_text("x\n" * 10)
    assert oversized(tmp_path, 10) == ["long.cpp: 11"]


def test_no_source_file_holds_more_than_one_files_worth():
    found = oversized(SRC, MAX_SOURCE_LINES)
    assert not found, f"split these by job (at most {MAX_SOURCE_LINES} lines a file):\n" + "\n".join(found)


# where a family's name may be spelled: its own description, the GGUF writers that emit a family's layout
# (an export and the synthetic shapes), the registry that names the transformers fallback's families, and the
# reader that reproduces transformers' own GGUF config rules (its mistral-from-general.name rule)
FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text")
FAMILY_BRANCH_ALLOWED = {"models/gguf_export.py", "models/synth.py", "models/synth_shapes.py", "models/registry.py",
                         "models/gguf_hf.py"}


def family_branches(source: str) -> list[tuple[int, str]]:
    """(line, compared name) of every == / != / in comparison against a family name: a branch on the family."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for c in ast.walk(node):
                if isinstance(c, ast.Constant) and c.value in FAMILY_NAMES:
                    out.append((node.lineno, c.value))
    return out


def test_the_family_branch_finder_sees_a_branch():
    """The negative control: a loader's branch on the model type is found, whichever comparison writes it."""
    src = "def f(mt):\n    if mt == 'qwen3':\n        pass\n    return mt in ('gemma3', 'x')\n"
    assert family_branches(src) == [(2, "qwen3"), (4, "gemma3")]


def test_one_description_per_family_and_no_family_branches_in_the_loaders():
    from leaplm.models import arch

    names = [a.name for a in arch.FAMILIES]
    assert len(names) == len(set(names)), f"a family described twice: {names}"
    types = [t for a in arch.FAMILIES for t in a.model_types]
    assert len(types) == len(set(types)), f"a model type claimed by two descriptions: {types}"
    found = []
    for path in sorted((SRC / "models").rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("models/arch/") or rel in FAMILY_BRANCH_ALLOWED:
            continue
        found += [f"{rel}:{line}: {name}" for line, name in family_branches(path.read_text())]
    assert not found, "read the family's description (models/arch/) instead of branching on its name:\n" + "\n".join(found)

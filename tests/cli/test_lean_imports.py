"""`leaplm generate` and `leaplm serve` import only what they use: neither training, benchmarks, tuning, deployment
recipes nor plotting, and on a GGUF file whose tokenizer is in the start-up cache, not transformers at all.

Each command runs as a program would run it (sys.argv, the `app` the console script calls) in a fresh process,
which then lists the modules it imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
NEVER = ("leaplm.training", "leaplm.bench", "leaplm.tune", "leaplm.deploy", "matplotlib",
         "leaplm.cli.train", "leaplm.cli.bench", "leaplm.cli.tune", "leaplm.cli.heads", "leaplm.cli.evaluate")
RUN = ("import json, sys; sys.argv = ['leaplm'] + json.loads(sys.argv[1]); from leaplm.cli import app\n"
       "try:\n    app()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
       "print('MODULES ' + json.dumps([code, sorted(sys.modules)]))")


def imported(args: list[str], cache: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "LEAPLM_CACHE": str(cache), "LEAPLM_NO_STARTUP_CACHE": "0"}
    out = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], capture_output=True, text=True,
                         timeout=300, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("MODULES ")), None)
    assert line is not None, out.stderr[-3000:]
    code, mods = json.loads(line[len("MODULES "):])
    assert code in (0, None), out.stderr[-3000:]
    return mods


def loaded(mods: list[str], prefixes) -> list[str]:
    return [m for m in mods if any(m == p or m.startswith(p + ".") for p in prefixes)]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from gguf_writer import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("lean"), "Q8_0")[0]


def test_generate_on_a_gguf_file_imports_only_what_it_uses(gguf_file, tmp_path):
    args = ["generate", "--model", gguf_file, "ab", "--max-new-tokens", "3", "--method", "none"]
    first = imported(args, tmp_path)                      # fills the start-up cache (the tokenizer, via transformers)
    assert loaded(first, NEVER) == []
    again = imported(args, tmp_path)
    assert loaded(again, NEVER + ("transformers",)) == []
    assert "leaplm.cli.generate" in again                 # the command did run


def test_the_embedded_default_imports_neither_transformers_nor_training(tmp_path):
    mods = imported(["generate", "def f(x):", "--max-new-tokens", "2"], tmp_path)
    assert loaded(mods, NEVER + ("transformers",)) == []
    assert "leaplm.propose.draft_model" in mods           # its default method ran: the shipped draft


def test_serve_s_command_line_imports_no_training(tmp_path):
    mods = imported(["serve", "--help"], tmp_path)
    assert loaded(mods, NEVER) == [] and "leaplm.cli.serve" in mods


def test_the_full_command_line_still_lists_every_command(tmp_path):
    from typer.main import get_command

    from leaplm.cli import app

    names = set(get_command(app).commands)
    assert {"generate", "serve", "bench", "tune", "train", "eval", "models"} <= names

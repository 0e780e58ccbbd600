"""`leaplm generate`'s summary line says how often adaptive K drafted at all, so a run where it kept K at 0 is
not read as a draft that accepts badly."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from leaplm.cli import app


@pytest.mark.parametrize("adaptive", [True, False])
def test_generate_says_how_often_adaptive_k_drafted(adaptive):
    args = ["generate", "def f(x):", "--max-new-tokens", "12"] + ([] if adaptive else ["--fixed-k"])
    r = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if "target forwards" in ln)
    forwards = int(line.split(" target forwards")[0].rsplit(" ", 1)[1])
    if adaptive:
        drafted, of = line.split("(adaptive: drafted in ")[1].split(" steps)")[0].split(" of ")
        assert int(of) == forwards and 0 <= int(drafted) <= forwards
    else:
        assert "adaptive" not in line

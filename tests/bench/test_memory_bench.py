"""`leaplm bench memory --model FILE`: the peak RSS of `leaplm generate` on the user's model, in a process of its
own."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from typer.testing import CliRunner

from leaplm.cli import app


def test_bench_memory_measures_generate_on_a_gguf_file(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from gguf_writer import write_tiny_gguf

    path = write_tiny_gguf(tmp_path, "Q8_0")[0]
    out = tmp_path / "mem.json"
    r = CliRunner().invoke(app, ["bench", "memory", "--model", path, "--prompt-tokens", "4", "--new-tokens", "3",
                                 "--json", str(out)], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    (fig,) = json.loads(out.read_text())["figures"]
    assert fig["command"].startswith("leaplm generate") and path in fig["command"]
    assert 50e6 < fig["peak_rss_bytes"] < 4e9                   # torch alone holds more than 50 MB
    assert fig["weights_bytes"] == Path(path).stat().st_size


def test_bench_memory_refuses_a_model_that_is_not_there(tmp_path):
    r = CliRunner().invoke(app, ["bench", "memory", "--model", str(tmp_path / "nope.gguf")])
    assert r.exit_code == 2 and "--model" in r.output

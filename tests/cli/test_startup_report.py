"""`leaplm generate --startup`: the time to the first token, its parts (which add up to it) and the peak RSS."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.cli.startup import PARTS, process_age

runner = CliRunner()


def _run(args):
    r = runner.invoke(app, args, env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    return r


def test_the_parts_add_up_to_the_time_to_first_token(tiny_llama):
    args = ["generate", "--model", tiny_llama.path, "1 2 3", "--max-new-tokens", "4", "--ignore-eos",
            "--method", "none"]
    plain = json.loads(_run(args + ["--json"]).stdout)
    out = json.loads(_run(args + ["--json", "--startup"]).stdout)
    rep = out["startup"]
    parts = [rep[f"{p}_s"] for p in PARTS]
    assert all(p >= 0 for p in parts)
    assert abs(sum(parts) - rep["time_to_first_token_s"]) < 5e-3          # each part rounded to 0.1 ms
    assert rep["load_s"] > 0 and rep["import_s"] > 0
    assert rep["time_to_first_token_s"] <= rep["wall_s"]
    assert rep["peak_rss_bytes"] > 50e6                                  # torch alone holds more
    assert out["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]   # timing it changes nothing


def test_the_report_is_printed_beside_the_text(tiny_llama):
    r = _run(["generate", "--model", tiny_llama.path, "1 2 3", "--max-new-tokens", "3", "--startup"])
    lines = r.output.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("time to first token "))
    assert "peak RSS" in lines[head]
    assert [ln.split()[0] for ln in lines[head + 1:head + 1 + len(PARTS)]] == [p.split("_")[0] for p in PARTS]


def test_startup_times_one_request():
    r = runner.invoke(app, ["generate", "x", "--startup", "-n", "2"])
    assert r.exit_code == 2 and "--startup" in r.output


def test_process_age_counts_from_the_process_start():
    age = process_age()
    assert age is not None and 0 < age < 24 * 3600

"""`leaplm bench serve --profile`: the latency table (TTFT, ITL, e2e, tokens/s) per traffic profile, speculation on
and off, measured on a real server process over the server tests' tiny pair (figures are not asserted: speed is
measured by the bench, never in a test)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from typer.testing import CliRunner

from leaplm.bench.serve_load import LoadBenchConfig
from leaplm.bench.serve_profiles import PROFILES, Profile, parse_profiles, profile_prompt, run_profiles
from leaplm.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serverkit import write_pair  # noqa: E402


def test_profiles_parse_and_prompts_have_their_length():
    assert [p.name for p in parse_profiles("short,medium,long,batch")] == ["short", "medium", "long", "batch"]
    for p in PROFILES.values():
        assert len(profile_prompt(p, 3)) == p.prompt_chars
    assert profile_prompt(PROFILES["short"], 0) != profile_prompt(PROFILES["short"], 1)


def test_unknown_profile_is_refused_naming_the_option():
    res = CliRunner().invoke(app, ["bench", "serve", "--profile", "short,huge"])
    assert res.exit_code == 2 and "--profile" in res.output and "huge" in res.output


def test_profile_table_on_a_real_server(tmp_path):
    target, draft = write_pair(tmp_path / "pair")
    out = tmp_path / "profiles.json"
    # --fixed-k: the adaptive controller may price drafting out on a slow machine, and then "on" rows never draft
    cfg = LoadBenchConfig(model=target, draft=draft, k=4, rounds=1, max_batch=4, threads=1, out=str(out),
                          fixed_k=True)
    profiles = [Profile("short", 40, 12, 1, 2), Profile("batch", 40, 12, 4, 4)]
    report = run_profiles(cfg, profiles)
    assert json.loads(out.read_text())["table"] == report["table"]
    rows = {(r["profile"], r["speculative"]): r for r in report["table"]}
    assert set(rows) == {("short", True), ("short", False), ("batch", True), ("batch", False)}
    for (name, spec), r in rows.items():
        assert r["errors"] == 0 and r["requests"] == (2 if name == "short" else 4)
        assert 0 < r["ttft_p50_s"] <= r["e2e_p50_s"] and r["itl_p50_s"] > 0
        assert r["tokens_per_s_request"] > 0 and r["tokens_per_s_total"] > 0
        assert (r["acceptance_rate"] is not None) == spec        # "off" rows never drafted
        assert r["speedup_vs_off"] > 0

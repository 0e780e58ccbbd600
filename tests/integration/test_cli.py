"""The command line as a user runs it: the --json contract, draft == none at temperature 0, clear errors."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from leaplm.cli import app

runner = CliRunner()
PROMPT = "def add(a, b):\n"


def run_json(*args: str) -> dict:
    res = runner.invoke(app, ["generate", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)          # exactly one JSON object, nothing else on stdout


@pytest.fixture(scope="module")
def target(checkpoint):
    return checkpoint("llama_tied")


@pytest.fixture(scope="module")
def draft(checkpoint):
    return checkpoint("llama_draft")


def test_json_contract(target, draft):
    # fixed K: every step drafts, so each stage of the time split has work on any machine (adaptive K may
    # price a draft out on a slow or loaded one and leave propose and verify at 0)
    out = run_json(PROMPT, "--model", target, "--draft", draft, "--method", "draft", "--k", "3",
                   "--max-new-tokens", "12", "--ignore-eos", "--fixed-k")
    assert set(out) == {"samples", "stats"}
    (s,) = out["samples"]
    assert set(s) == {"text", "token_ids", "finish_reason"} and s["finish_reason"] == "length"
    assert len(s["token_ids"]) == 12 and all(isinstance(t, int) for t in s["token_ids"])
    st = out["stats"]
    for key in ("method", "k", "new_tokens", "target_forwards", "draft_tokens", "accepted_tokens",
                "acceptance_rate", "mean_accepted_length", "decode_s", "tokens_per_s"):
        assert key in st
    assert st["method"] == "draft" and st["k"] == 3 and st["new_tokens"] == 12
    assert st["mean_accepted_length"] == pytest.approx(12 / st["target_forwards"], abs=1e-3)
    # the step's time split into its four stages, each measured, together within the decode time
    parts = [st[k] for k in ("propose_s", "score_s", "verify_s", "commit_s")]
    assert all(p > 0 for p in parts) and sum(parts) <= st["decode_s"] + 1e-4   # rounding


@pytest.mark.parametrize("k", ["1", "4"])
def test_draft_equals_none_at_temperature_0(target, draft, k):
    common = [PROMPT, "--model", target, "--temperature", "0", "--max-new-tokens", "40", "--ignore-eos"]
    none = run_json(*common, "--method", "none")
    spec = run_json(*common, "--method", "draft", "--draft", draft, "--k", k, "--fixed-k")
    assert spec["samples"][0]["token_ids"] == none["samples"][0]["token_ids"]
    assert spec["stats"]["draft_tokens"] > 0


def test_n_samples_and_stdin(target):
    res = runner.invoke(app, ["generate", "--model", target, "--method", "none", "-n", "3", "--temperature", "1",
                              "--seed", "5", "--max-new-tokens", "8", "--ignore-eos", "--json"], input=PROMPT)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert len(out["samples"]) == 3 and out["stats"]["new_tokens"] == 24
    again = json.loads(runner.invoke(app, ["generate", "--model", target, "--method", "none", "-n", "3",
                                           "--temperature", "1", "--seed", "5", "--max-new-tokens", "8",
                                           "--ignore-eos", "--json"], input=PROMPT).stdout)
    assert [s["token_ids"] for s in again["samples"]] == [s["token_ids"] for s in out["samples"]]
    # the samples are the rows of one batch; seeded (the race), each is the same seed's sample alone
    alone = json.loads(runner.invoke(app, ["generate", "--model", target, "--method", "none", "--temperature", "1",
                                           "--seed", "6", "--max-new-tokens", "8", "--ignore-eos", "--json"],
                                     input=PROMPT).stdout)
    assert alone["samples"][0]["token_ids"] == out["samples"][1]["token_ids"]


def test_stream_prints_text(target):
    res = runner.invoke(app, ["generate", PROMPT, "--model", target, "--method", "none", "--stream",
                              "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output
    assert PROMPT.strip() in res.stdout


@pytest.mark.parametrize("args, needle", [
    (["--k", "0"], "--k"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--method", "telepathy"], "--method"),
    (["-n", "0"], "-n"),
    (["--temperature", "0.8", "--verifier", "exact"], "--verifier"),
])
def test_bad_options_name_the_field(target, args, needle):
    res = runner.invoke(app, ["generate", PROMPT, "--model", target, *args])
    assert res.exit_code == 2
    assert needle in res.output and "Traceback" not in res.output


def test_missing_model_path():
    res = runner.invoke(app, ["generate", PROMPT, "--model", "/no/such/model", "--method", "none"])
    assert res.exit_code == 2 and "--model" in res.output and "does not exist" in res.output


def test_empty_prompt(target):
    res = runner.invoke(app, ["generate", "", "--model", target, "--method", "none"])
    assert res.exit_code == 2 and "prompt" in res.output


def test_prediction_file_reports_its_counts(target, tmp_path):
    """--prediction FILE: the same tokens as without it, and --json reports the accepted and rejected prediction
    tokens; an unreadable file is an error naming the flag."""
    common = [PROMPT, "--model", target, "--temperature", "0", "--max-new-tokens", "30", "--ignore-eos",
              "--method", "none"]
    plain = run_json(*common)
    p = tmp_path / "prediction.txt"
    p.write_text(plain["samples"][0]["text"], encoding="utf-8")
    got = run_json(*common, "--prediction", str(p), "--fixed-k")
    assert got["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    st = got["stats"]
    assert st["accepted_prediction_tokens"] > 0
    assert st["accepted_prediction_tokens"] + st["rejected_prediction_tokens"] <= st["draft_tokens"]
    assert plain["stats"]["accepted_prediction_tokens"] == plain["stats"]["rejected_prediction_tokens"] == 0
    res = runner.invoke(app, ["generate", *common, "--prediction", str(tmp_path / "missing.txt")])
    assert res.exit_code != 0 and "--prediction" in res.output

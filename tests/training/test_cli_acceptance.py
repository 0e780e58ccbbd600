"""`leaplm eval acceptance` and `leaplm train ondata`: bad options are refused naming the option; a tiny run works."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from leaplm.cli import app

runner = CliRunner()


@pytest.mark.parametrize("args, needle", [
    (["--k", "0"], "--k"),
    (["--k", "two"], "--k"),
    (["--temperatures", "-1"], "--temperatures"),
    (["--draft", "/no/such/draft"], "--draft"),
])
def test_eval_acceptance_bad_options(checkpoint, args, needle):
    res = runner.invoke(app, ["eval", "acceptance", "--target", checkpoint("llama_tied"), *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output


def test_eval_acceptance_writes_rows(checkpoint, tmp_path):
    out = tmp_path / "acc.json"
    res = runner.invoke(app, ["eval", "acceptance", "--target", checkpoint("llama_tied"), "--draft",
                              checkpoint("llama_tied"), "--k", "1,2", "--temperatures", "0", "--prompts", "1",
                              "--max-new-tokens", "6", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert [r["K"] for r in rows] == [1, 2]
    assert all(r["acceptance rate"] == 1.0 for r in rows)     # the target as its own draft is always accepted


def test_ondata_refuses_missing_target(tmp_path):
    res = runner.invoke(app, ["train", "ondata", "--target", str(tmp_path / "none"), "--out", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "--target" in res.output


@pytest.mark.parametrize("extra,option", [
    (["--top-k", "8", "--temperature", "-0.5"], "--temperature"),
    (["--top-k", "8", "--part", "2", "--parts", "2"], "--part"),
    (["--top-k", "0"], "--top-k"),
    (["--top-k", "8", "--prompt-lengths", "96,x"], "--prompt-lengths"),
    (["--top-k", "300"], "--top-k"),
])
def test_ondata_cached_logit_options_are_checked(tmp_path, tiny_target_dir, extra, option):
    res = runner.invoke(app, ["train", "ondata", "--target", str(tiny_target_dir), "--out", str(tmp_path / "d"),
                              *extra], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 2, res.output
    assert option in res.output and "Traceback" not in res.output
    assert not (tmp_path / "d").exists()


def test_distill_refuses_a_logits_dir_without_shards(tmp_path, tiny_target_dir, tiny_draft_dir):
    (tmp_path / "empty").mkdir()
    res = runner.invoke(app, ["train", "distill", "--target", str(tiny_target_dir), "--draft-init", str(tiny_draft_dir),
                              "--out", str(tmp_path / "o"), "--logits-dir", str(tmp_path / "empty")],
                        env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 2, res.output
    assert "--logits-dir" in res.output and "no shard" in res.output


@pytest.mark.parametrize("extra,option", [
    (["--loss", "js"], "--loss"),
    (["--temperatures", "0.8,0"], "--temperatures"),
    (["--temperatures", "hot"], "--temperatures"),
    (["--loss", "tv"], "--loss"),                        # a tempered/TV loss needs cached logits
])
def test_distill_loss_options_are_checked_before_any_work(tmp_path, tiny_target_dir, tiny_draft_dir, extra, option):
    res = runner.invoke(app, ["train", "distill", "--target", str(tiny_target_dir), "--draft-init", str(tiny_draft_dir),
                              "--out", str(tmp_path / "o"), *extra], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 2, res.output
    assert option in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()

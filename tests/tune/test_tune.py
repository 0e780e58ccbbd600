"""leaplm tune on tiny fixture models (fast) and on the embedded family (slow): decisions, bad input, flags."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.config import ConfigError
from leaplm.devices import check_device
from leaplm.tune.candidates import Candidate
from leaplm.tune.recommend import Row, decide, decide_level, flags_for


def _row(level, c, speedup, acc=0.5, tps=10.0):
    return Row(level, c, "", tps, speedup, acc if c.method != "none" else None, None, None, 4, 0.0, "")


def test_decide_picks_the_best_and_says_off_below_the_gain():
    none, a, b = Candidate("none"), Candidate("ngram", 4), Candidate("draft", 2, "/d", "d")
    rows = [_row(1, none, 1.0), _row(1, a, 1.2), _row(1, b, 1.6),
            _row(16, none, 1.0), _row(16, a, 1.03), _row(16, b, 0.7)]
    on = decide_level(rows, 1, 0.05)
    assert on.speculate and on.choice == b and on.speedup == 1.6
    off = decide_level(rows, 16, 0.05)
    assert not off.speculate and off.choice is None and off.best_label == "ngram k=4" and "1.05x" in off.reason
    d = decide(rows, [1, 16], 0.05, "m", {"d": "/d"}, True)
    assert d.speculate and "--method draft --k 2 --draft /d" in d.serve_command
    assert any("concurrency 16" in n for n in d.notes)
    assert not decide([r for r in rows if r.level == 16], [16], 0.05, "m", {}, True).speculate


def test_flags_for_off_and_for_a_method():
    assert "--method none" in flags_for(None, "m", None, True)["serve"]
    f = flags_for(Candidate("ngram", 8), "m", None, False)
    assert f["serve"] == "leaplm serve --model m --method ngram --k 8 --fixed-k"
    assert '"method": "ngram"' in f["vllm_style"] and "adaptive_k=False" in f["python"]


def test_device_names_are_checked_naming_the_field():
    assert check_device("cpu", "draft_device") == "cpu"
    with pytest.raises(ConfigError) as e:
        check_device("gpu0", "draft_device")
    assert e.value.field == "draft_device"
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="not available") as e:
            check_device("cuda:1", "draft_device")
        assert e.value.field == "draft_device"


def _tune(*args):
    return CliRunner().invoke(app, ["tune", *args])


def test_tune_on_tiny_models_recommends_a_measured_configuration(checkpoint, tiny_llama, tmp_path):
    other = tiny_llama.path                       # word-level tokenizer: not the target's
    res = _tune("--model", checkpoint("llama_tied"), "--draft", checkpoint("llama_draft"), "--draft", other,
                "--methods", "draft,ngram", "--workload", "copy", "--concurrency", "1,2", "--prompts", "2",
                "--max-new-tokens", "8", "--budget-s", "60", "--max-rounds", "2", "--k-grid", "2,4", "--json",
                "--plot", str(tmp_path))
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    skipped = [s for s in out["skipped"] if s.startswith(f"draft {tiny_llama.path.rstrip('/').split('/')[-1]}")]
    assert len(skipped) == 1 and "tokenizer" in skipped[0] and "disagrees" in skipped[0]
    configs = {(r["concurrency"], r["config"]) for r in out["rows"]}
    assert (1, "none") in configs and (2, "none") in configs
    for r in out["rows"]:
        assert r["tokens_per_s"] > 0
        if r["method"] != "none":
            assert r["identical"] is True                     # greedy: every configuration equals the baseline
    for lv in out["decision"]["levels"]:
        measured = {r["config"]: r["speedup"] for r in out["rows"] if r["concurrency"] == lv["level"]}
        if lv["speculate"]:
            assert lv["choice"] in measured and lv["speedup"] == max(v for k, v in measured.items() if k != "none")
        else:
            assert lv["choice"] == "off"
    assert (tmp_path / "tune_speedup_vs_k.png").stat().st_size > 0


def test_tune_recommends_off_when_nothing_pays(checkpoint):
    """Random noise prompts sampled at temperature 1 from a random target; the draft is an unrelated random
    model and lookup finds nothing to copy: no method reaches the required gain at concurrency 4."""
    res = _tune("--model", checkpoint("llama_tied"), "--draft", checkpoint("llama_draft"),
                "--methods", "draft,ngram", "--workload", "noise", "--concurrency", "4", "--prompts", "4",
                "--max-new-tokens", "16", "--temperature", "1.0", "--budget-s", "60", "--max-rounds", "2", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["decision"]["speculate"] is False
    assert "--method none" in out["decision"]["serve"]
    assert [lv["choice"] for lv in out["decision"]["levels"]] == ["off"]


def test_impossible_budget_names_the_minimum(checkpoint):
    res = _tune("--model", checkpoint("llama_tied"), "--methods", "ngram", "--budget-s", "0.01", "--prompts", "1",
                "--max-new-tokens", "8", "--concurrency", "1")
    assert res.exit_code == 2
    assert "--budget-s" in res.output and "minimum" in res.output


@pytest.mark.parametrize("args,field", [(["--concurrency", "0"], "--concurrency"),
                                        (["--methods", "hydra"], "--methods"),
                                        (["--draft-device", "cuda:7"], "--draft-device"),
                                        (["--workload", "/no/such/file.txt"], "--workload"),
                                        (["--budget-s", "nan"], "--budget-s")])
def test_bad_input_names_the_option(checkpoint, args, field):
    res = _tune("--model", checkpoint("llama_tied"), *args)
    assert res.exit_code == 2 and field in res.output, res.output


def test_heads_are_tried_with_the_head_shipped_for_the_target_and_skipped_otherwise(checkpoint):
    from leaplm.models import embedded, load_model
    from leaplm.tune.candidates import build_candidates

    tiny = load_model(checkpoint("llama_tied"))
    got = build_candidates(tiny, {}, ["eagle", "medusa", "ngram"])
    assert {c.method for c in got.ordered} == {"ngram"}
    assert any(s.startswith("eagle:") and "leaplm train eagle" in s for s in got.skipped)
    assert any(s.startswith("medusa:") and "leaplm train medusa" in s for s in got.skipped)

    target = load_model(embedded.default_target())     # an EAGLE head ships for the embedded target
    got = build_candidates(target, {}, ["eagle"])
    assert [c.label for c in got.ordered] == ["eagle k=4", "eagle k=8"] and not got.skipped

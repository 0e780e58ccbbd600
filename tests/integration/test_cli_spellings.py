"""The spellings vLLM and llama.cpp users type (cli/aliases.py): accepted with the same meaning, or refused with
exit code 2 and an error that names leaplm's option."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from leaplm.cli import app

runner = CliRunner()
PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def target(checkpoint):
    return checkpoint("llama_tied")


@pytest.fixture(scope="module")
def draft(checkpoint):
    return checkpoint("llama_draft")


def gen(*args: str):
    return runner.invoke(app, ["generate", PROMPT, "--max-new-tokens", "6", *args])


def gen_json(*args: str) -> dict:
    res = gen(*args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["stats"]


def test_vllm_speculative_config(target):
    st = gen_json("--model", target, "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}')
    assert (st["method"], st["k"]) == ("ngram", 3)


def test_llama_cpp_draft_spellings(target, draft):
    st = gen_json("-m", target, "-md", draft, "--draft-max", "2", "-c", "64", "-t", "1", "-ngl", "0")
    assert (st["method"], st["k"], st["max_model_len"]) == ("draft", 2, 64)


@pytest.mark.parametrize("args, flag, says", [
    (["-n", "128"], "-n", "--max-new-tokens 128"),
    (["--draft-min", "2"], "--draft-min", "--k"),
    (["-ngl", "99"], "-ngl", "--device"),
    (["--speculative-config", '{"method": "ngram", "lookup": 3}'], "--speculative-config", "'lookup'"),
    (["--speculative-config", '{"method": "eagle9"}'], "--speculative-config", "'eagle9'"),
    (["--speculative-config", "{not json"], "--speculative-config", "not valid JSON"),
])
def test_refused_with_leaplms_name(args, flag, says, target):
    res = gen("--model", target, *args)
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())
    assert f"{flag}:" in line and says in line and "Traceback" not in res.output


def test_serve_positional_model_and_speculative_config(target, monkeypatch):
    from leaplm.cli import serve as cli_serve

    seen = {}

    def fake_run_server(config, load, model_name):       # what serve would run, without binding a port
        seen["engine"], seen["name"] = load(), model_name
        return 0

    monkeypatch.setattr(cli_serve, "run_server", fake_run_server)
    res = runner.invoke(app, ["serve", target, "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}'])
    assert res.exit_code == 0, res.output
    eng = seen["engine"]
    assert seen["name"] == target and eng.target.name == target
    assert (eng.spec.method, eng.spec.k, eng.spec.ngram_max) == ("ngram", 4, 2)
    res = runner.invoke(app, ["serve", target, "--model", target + "x"])
    assert res.exit_code == 2 and "--model" in res.output


def test_samples_has_its_own_spelling_with_the_apis_limit(target):
    res = gen("--model", target, "--method", "none", "--samples", "20", "--max-new-tokens", "2", "--temperature",
              "1", "--seed", "3", "--json")
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["samples"]) == 20
    for args, flag, says in ((["--samples", "129"], "--samples", "128"), (["-n", "20"], "-n", "--samples 20"),
                             (["-n", "2", "--samples", "3"], "-n", "not both")):
        res = gen("--model", target, *args)
        line = " ".join(res.output.split())
        assert res.exit_code == 2 and f"{flag}:" in line and says in line, res.output

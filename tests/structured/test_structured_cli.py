"""`leaplm generate --json-schema/--regex/--grammar/--choice` and `leaplm bench`'s structured workloads: what the
flags ask for is what the engine generates (the same tokens as the Python API), bad input names the flag."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from leaplm import Engine, SamplingParams, StructuredOutput
from leaplm.cli import app

runner = CliRunner()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from letters import _root_conftest

    root = _root_conftest()
    d = tmp_path_factory.mktemp("cli_structured")
    tok = root.write_byte_tokenizer(d / "tok")
    return root.write_family_checkpoint(d / "target", "llama_tied", tok)


def run_json(*args) -> dict:
    r = runner.invoke(app, ["generate", *args, "--json", "--max-new-tokens", "40"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flag, value, spec", [
    ("--json-schema", "FILE", StructuredOutput(json=SCHEMA)),
    ("--regex", "(the|fox) [a-z]{2,6}", StructuredOutput(regex="(the|fox) [a-z]{2,6}")),
    ("--grammar", "FILE", StructuredOutput(grammar='root ::= "go " ("left" | "right")')),
])
def test_flags_constrain_generate(flag, value, spec, target, tmp_path):
    if flag == "--json-schema":
        value = str(tmp_path / "s.json")
        (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    elif flag == "--grammar":
        value = str(tmp_path / "g.gbnf")
        (tmp_path / "g.gbnf").write_text(spec.grammar)
    out = run_json("the quick brown fox", "-m", target, "--method", "ngram", flag, value)
    ref = Engine(target, method="none").generate("the quick brown fox", SamplingParams(
        temperature=0, max_new_tokens=40, structured=spec))
    assert out["samples"][0]["token_ids"] == ref.token_ids
    assert out["samples"][0]["finish_reason"] == ref.finish_reason == "stop"


def test_choice_is_repeatable(target):
    out = run_json("the", "-m", target, "--method", "none", "--choice", "quick fox", "--choice", "lazy dog")
    assert out["samples"][0]["text"] in ("quick fox", "lazy dog")
    assert out["stats"]["forced_tokens"] >= 1               # once the first word is chosen, the rest is forced


@pytest.mark.parametrize("args, words", [
    (["--regex", "a("], "--regex: "),
    (["--json-schema", "/no/such/file.json"], "--json-schema: cannot read"),
    (["--regex", "a", "--choice", "b"], "--choice: give one of"),
])
def test_bad_flags_name_the_flag(args, words, target):
    r = runner.invoke(app, ["generate", "x", "-m", target, *args])
    assert r.exit_code != 0 and words in r.output, r.output


def test_bad_schema_file_names_the_flag_and_the_reason(target, tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    r = runner.invoke(app, ["generate", "x", "-m", target, "--json-schema", str(p)])
    assert r.exit_code != 0 and "--json-schema: " in r.output and "uniqueItems" in r.output


def test_bench_runs_structured_workloads(target):
    r = runner.invoke(app, ["bench", "-m", target, "--workloads", "tool-call", "--prompts", "1", "--rounds", "1",
                            "--max-new-tokens", "24", "--methods", "none,none+schema:forced_tokens=0,ngram+schema"])
    assert r.exit_code == 0, r.output
    assert "ngram k=4 +schema" in r.output and "valid" in r.output
    r = runner.invoke(app, ["bench", "-m", target, "--workloads", "code", "--methods", "none,ngram+schema"])
    assert r.exit_code != 0 and "json-extract" in r.output

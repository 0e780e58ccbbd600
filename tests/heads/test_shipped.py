"""The EAGLE head shipped for the embedded target is found for it by its weights' hash and listed by
`leaplm models`."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.heads.checkpoint import weights_sha256
from leaplm.heads.loader import shipped_heads
from leaplm.models import embedded


def test_shipped_head_is_for_the_embedded_target():
    heads = shipped_heads("eagle")
    assert "eagle-target" in heads
    meta = json.loads((heads["eagle-target"] / "config.json").read_text())
    assert meta["target"]["weights_sha256"] == weights_sha256(embedded.embedded_path(embedded.TARGET))
    assert (heads["eagle-target"] / "loss_curve.png").exists() and (heads["eagle-target"] / "README.md").exists()


def test_models_lists_the_head():
    r = CliRunner().invoke(app, ["models"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert "eagle-target" in r.output and "eagle head" in r.output


def test_shipped_head_loads_and_drafts_for_the_embedded_target():
    from leaplm import Engine, SamplingParams
    from leaplm.models import load_model

    target = load_model(str(embedded.embedded_path(embedded.TARGET)))
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    ids = target.tokenizer("def add(a, b):\n")["input_ids"]
    out = Engine(target, method="eagle", k=3, adaptive_k=False).generate(ids, params)
    assert out.token_ids == Engine(target, method="none").generate(ids, params).token_ids
    assert out.stats.draft_tokens > 0

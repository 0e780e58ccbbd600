"""The EAGLE and Medusa heads shipped for the embedded target are found for it by its weights' hash and listed
by `leaplm models`."""
from __future__ import annotations

import json

from typer.testing import CliRunner

import pytest

from leaplm.cli import app
from leaplm.heads.checkpoint import weights_sha256
from leaplm.heads.loader import shipped_heads
from leaplm.models import embedded


KINDS = pytest.mark.parametrize("kind", ["eagle", "medusa"])


@KINDS
def test_shipped_head_is_for_the_embedded_target(kind):
    heads = shipped_heads(kind)
    name = f"{kind}-target"
    assert name in heads
    meta = json.loads((heads[name] / "config.json").read_text())
    assert meta["target"]["weights_sha256"] == weights_sha256(embedded.embedded_path(embedded.TARGET))
    assert (heads[name] / "loss_curve.png").exists() and (heads[name] / "README.md").exists()


@KINDS
def test_models_lists_the_head(kind):
    r = CliRunner().invoke(app, ["models"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert f"{kind}-target" in r.output and f"{kind} head" in r.output


@KINDS
def test_shipped_head_loads_and_drafts_for_the_embedded_target(kind):
    from leaplm import Engine, SamplingParams
    from leaplm.models import load_model

    target = load_model(str(embedded.embedded_path(embedded.TARGET)))
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    ids = target.tokenizer("def add(a, b):\n")["input_ids"]
    out = Engine(target, method=kind, k=3, adaptive_k=False).generate(ids, params)
    assert out.token_ids == Engine(target, method="none").generate(ids, params).token_ids
    assert out.stats.draft_tokens > 0


def test_ship_head_stores_bf16_keeps_the_maps_and_writes_the_card(eagle16, tmp_path):
    """`train ship-head`: floats in bfloat16, the draft vocabulary's maps unchanged, the card with the
    acceptance table and command; the shipped head still loads and decodes losslessly."""
    import torch
    from safetensors.torch import load_file

    from leaplm import Engine, SamplingParams

    rows = tmp_path / "acc.json"
    rows.write_text(json.dumps([{"temperature": 0.0, "K": 4, "acceptance rate": 0.5}]))
    r = CliRunner().invoke(app, ["train", "ship-head", "--head", eagle16["reduced"], "--out", str(tmp_path / "s"),
                                 "--acceptance", str(rows), "--command", "leaplm train eagle --chat"])
    assert r.exit_code == 0, r.output
    src, got = load_file(f"{eagle16['reduced']}/model.safetensors"), load_file(str(tmp_path / "s/model.safetensors"))
    assert got["fc.weight"].dtype == torch.bfloat16 and torch.equal(got["fc.weight"], src["fc.weight"].bfloat16())
    assert torch.equal(got["d2t"], src["d2t"]) and torch.equal(got["t2d"], src["t2d"])
    card = (tmp_path / "s" / "README.md").read_text()
    assert "leaplm train eagle --chat" in card and "0.5" in card and "draft vocabulary" in card
    target = eagle16["target"]
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    out = Engine(target, method="eagle", k=4, head=str(tmp_path / "s")).generate([1, 2, 3], params)
    assert out.token_ids == Engine(target, method="none").generate([1, 2, 3], params).token_ids


def test_shipped_smollm2_head_is_well_formed():
    """The SmolLM2 head (its target, a 93 MB GGUF, is only in the slow tests): its weights fit its config, its
    draft vocabulary's maps are valid, and it is matched to SmolLM2's file by hash like any shipped head."""
    from leaplm.heads.checkpoint import read_head
    from leaplm.heads.eagle_net import EagleConfig, EagleNet
    from leaplm.heads.runtime import load_weights
    from leaplm.heads.vocab import ids_of

    d = shipped_heads("eagle")["eagle-smollm2"]
    hf = read_head(d)
    assert (hf.target.hidden_size, hf.target.vocab_size, hf.target.num_hidden_layers) == (576, 49152, 30)
    net = EagleNet(EagleConfig(**hf.config))
    load_weights(net, hf.state, d)
    assert ids_of(net.d2t, net.t2d, 49152, str(d)).numel() == hf.config["draft_vocab_size"] == 4096

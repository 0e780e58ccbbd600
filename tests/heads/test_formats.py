"""Export a trained EAGLE head to the Speculators and EAGLE layouts, import it back: same weights, same
proposals; files from other tools' naming variants load; heads for another target are refused."""
from __future__ import annotations

import json

import pytest
import torch

from leaplm import Engine, SamplingParams
from leaplm.config import ConfigError
from leaplm.heads.formats import export_head
from leaplm.heads.loader import load_head_for
from leaplm.propose.eagle import EagleProposer
from leaplm.propose.base import ProposeContext
from leaplm.sampling import LogitsProcessor

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def proposals(head, target, steps: int = 6) -> list:
    """The proposals of a fresh proposer over a fixed context, fed the target's real features."""
    from leaplm.training.eagle import target_batch

    b = target_batch(target.model, torch.tensor([PROMPT]), 1, 0.0, torch.Generator())   # feats of PROMPT
    out = []
    for n in range(4, 4 + steps):
        prop = EagleProposer(head, 64)
        prop.observe_hidden(0, b.feats[0, : n - 1])
        params = SamplingParams(temperature=0)
        ctx = ProposeContext(PROMPT[:n], 6, params, LogitsProcessor(params), None, None)
        p = prop.propose(ctx)
        out.append((p.tokens.tolist(), p.parents))
    return out


@pytest.mark.parametrize("which", ["head", "reduced"])
@pytest.mark.parametrize("layout", ["speculators", "eagle"])
def test_export_then_import_gives_the_same_proposals(eagle16, tmp_path, layout, which):
    """reduced: the draft vocabulary travels as EAGLE-3 files carry it (d2t offsets, t2d mask, own lm_head)."""
    target = eagle16["target"]
    head = eagle16[which]
    d = export_head(head, tmp_path / layout, target, layout)
    cfg = json.loads((d / "config.json").read_text())
    if which == "reduced":
        from safetensors.torch import load_file

        w = load_file(str(d / "model.safetensors")) if layout == "speculators" else torch.load(d / "pytorch_model.bin")
        V, N = target.model.args.vocab_size, 6
        assert w["d2t"].dtype == torch.int64 and w["d2t"].shape == (N,)
        assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (V,) and int(w["t2d"].sum()) == N
        ids = torch.arange(N) + w["d2t"]                  # target id = draft id + offset (vLLM's reading)
        assert w["t2d"][ids].all() and w["lm_head.weight"].shape[0] == N
        assert (cfg.get("draft_vocab_size") or cfg["transformer_layer_config"]["draft_vocab_size"]) == N
    if layout == "speculators":
        assert cfg["speculators_model_type"] == "eagle" and cfg["layernorms"] is False
        assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1
        from safetensors.torch import load_file

        keys = set(load_file(str(d / "model.safetensors")))
        assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
                "embed_tokens.weight", "lm_head.weight"} <= keys
        assert "layers.0.input_layernorm.weight" not in keys
    else:
        assert cfg["num_hidden_layers"] == 1 and (d / "pytorch_model.bin").exists()
    a, b = load_head_for(head, target), load_head_for(str(d), target)
    assert sorted(a.net.state_dict()) == sorted(b.net.state_dict())
    for (k, va), (_, vb) in zip(sorted(a.net.state_dict().items()), sorted(b.net.state_dict().items())):
        assert torch.equal(va, vb), k
    assert proposals(a, target) == proposals(b, target)
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    ra = Engine(target, method="eagle", k=4, head=head, adaptive_k=False).generate(PROMPT, params)
    rb = Engine(target, method="eagle", k=4, head=str(d), adaptive_k=False).generate(PROMPT, params)
    assert ra.token_ids == rb.token_ids and ra.stats.accepted_tokens == rb.stats.accepted_tokens


def test_original_eagle_layout_with_fc_bias_and_old_speculators_names(eagle16, tmp_path):
    """EAGLE's repositories put a bias on fc and keep layers.0.input_layernorm (unused); older Speculators files
    say fusion_fc and transformer.*. Both load; the bias is used."""
    target = eagle16["target"]
    d = export_head(eagle16["head"], tmp_path / "e", target, "eagle")
    sd = torch.load(d / "pytorch_model.bin")
    sd["fc.bias"] = torch.full((sd["fc.weight"].shape[0],), 0.5)
    sd["layers.0.input_layernorm.weight"] = torch.ones(sd["fc.weight"].shape[0])
    torch.save(sd, d / "pytorch_model.bin")
    cfg = json.loads((d / "config.json").read_text())
    cfg["bias"] = True
    del cfg["leaplm_target"]                      # as EAGLE writes it: the embedding then identifies the target
    (d / "config.json").write_text(json.dumps(cfg))
    h = load_head_for(str(d), target)
    assert torch.equal(h.net.fc.bias, sd["fc.bias"])
    s = export_head(eagle16["head"], tmp_path / "s", target, "speculators")
    from safetensors.torch import load_file, save_file

    w = load_file(str(s / "model.safetensors"))
    w = {k.replace("fc.", "fusion_fc.").replace("layers.0.", "transformer."): v for k, v in w.items()}
    save_file(w, str(s / "model.safetensors"))
    old = load_head_for(str(s), target)
    assert torch.equal(old.net.q_proj.weight, load_head_for(eagle16["head"], target).net.q_proj.weight)


def test_imports_for_another_target_or_damaged_are_refused(eagle16, tiny_llama_factory, tmp_path):
    target = eagle16["target"]
    other = tiny_llama_factory(vocab=16, layers=2, seed=11)       # same shapes, other weights
    s = export_head(eagle16["head"], tmp_path / "s", target, "speculators")
    with pytest.raises(ConfigError, match="weights_sha256"):
        Engine(other, method="eagle", head=str(s))
    e = export_head(eagle16["head"], tmp_path / "e", target, "eagle")
    cfg = json.loads((e / "config.json").read_text())
    del cfg["leaplm_target"]
    (e / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="embed_tokens differ"):
        Engine(other, method="eagle", head=str(e))
    cfg["hidden_size"] = 64
    (e / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size"):
        Engine(target, method="eagle", head=str(e))
    w = s / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ConfigError, match="corrupt or truncated"):
        Engine(target, method="eagle", head=str(s))

"""Medusa-1 heads: training lowers the loss in seconds; greedy output equals plain decoding for trees of several
sizes; sampled output follows the target's distribution (Monte Carlo, tests/engine/mc_bounds.py) in mixed
batches, with untrained (miscalibrated) heads too."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from head_helpers import train_tiny_eagle, write_word_corpus
from leaplm import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from mc_bounds import tv_and_bound  # noqa: E402
from test_batch_distribution import N, sample_in_batches  # noqa: E402
from test_lossless_sampling import PROCESSED, exact_positions_2_3  # noqa: E402


@pytest.fixture(scope="module")
def medusa16(tiny_llama_factory, tmp_path_factory):
    target = tiny_llama_factory(vocab=16, layers=2, seed=3)
    d = tmp_path_factory.mktemp("medusa16")
    logs = train_tiny_eagle(target.path, write_word_corpus(d / "c.jsonl", 16), d / "head", steps=30,
                            kind="medusa", medusa_heads=3)
    return {"target": target, "head": str(d / "head"), "logs": logs}


def test_training_lowers_the_loss(medusa16):
    logs = medusa16["logs"]
    first, last = sum(l.loss for l in logs[:3]) / 3, sum(l.loss for l in logs[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert len(logs[-1].agree) == 3                         # one figure per head


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_equals_none(medusa16, k):
    target = medusa16["target"]
    eng = Engine(target, method="medusa", k=k, head=medusa16["head"], adaptive_k=False)
    drafted = 0
    for prompt in ([1, 2, 3], [5], [7, 3, 9, 3, 7, 1, 2, 2, 4, 11, 12]):
        params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
        assert eng.generate(prompt, params).token_ids == \
            Engine(target, method="none").generate(prompt, params).token_ids
        drafted += eng.generate(prompt, params).stats.draft_tokens
    assert drafted > 0


def test_sampled_rows_follow_the_target(tiny_vocab, ref_probs, tmp_path):
    """Untrained heads start as the identity (each guesses the token after f_t): miscalibrated on purpose."""
    target = tiny_vocab["target"]
    train_tiny_eagle(target.path, write_word_corpus(tmp_path / "c.jsonl", 8), tmp_path / "h", steps=1,
                     kind="medusa", medusa_heads=3, lr=1e-9)
    exact = exact_positions_2_3(target.path, SamplingParams(**PROCESSED), ref_probs)
    eng = Engine(target, draft=tiny_vocab["near"], method="draft", k=4, head=str(tmp_path / "h"), adaptive_k=False)
    got = sample_in_batches(eng, PROCESSED, kinds=[("medusa", 4), ("none", None), ("medusa", 2), ("draft", 2)])
    tv, bound = tv_and_bound(got, exact, N)
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f}"


def test_a_shipped_medusa_head_is_picked_for_its_target_and_listed(medusa16, eagle16, tmp_path, monkeypatch):
    """`train ship-head` stores a Medusa head like an EAGLE one; with no --head, --method medusa takes the shipped
    medusa head whose target hash matches (not the eagle head for the same target, not a head for another
    target), and `leaplm models` lists it."""
    import json

    import torch
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from leaplm.cli import app
    from leaplm.config import ConfigError
    from leaplm.heads import loader
    from leaplm.models import embedded

    shelf = tmp_path / "embedded"
    run = CliRunner()
    for name, src in (("medusa-tiny", medusa16["head"]), ("eagle-tiny", eagle16["head"]),
                      ("aaa-medusa-other", medusa16["head"])):
        r = run.invoke(app, ["train", "ship-head", "--head", src, "--out", str(shelf / name)])
        assert r.exit_code == 0, r.output
    other = shelf / "aaa-medusa-other" / "config.json"          # sorts first; trained for another target
    meta = json.loads(other.read_text())
    meta["target"]["weights_sha256"] = "0" * 64
    other.write_text(json.dumps(meta))
    got = load_file(str(shelf / "medusa-tiny" / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert (shelf / "medusa-tiny" / "README.md").read_text().startswith("# leaplm medusa head")
    monkeypatch.setattr(loader, "EMBEDDED_DIR", shelf)
    monkeypatch.setattr(embedded, "EMBEDDED_DIR", shelf)

    target = medusa16["target"]
    assert loader.default_head_dir(target, "medusa") == shelf / "medusa-tiny"
    assert loader.default_head_dir(target, "eagle") == shelf / "eagle-tiny"
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    out = Engine(target, method="medusa", k=3, adaptive_k=False).generate([1, 2, 3], params)
    assert out.token_ids == Engine(target, method="none").generate([1, 2, 3], params).token_ids
    assert out.stats.draft_tokens > 0
    r = run.invoke(app, ["models"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert "medusa-tiny" in r.output and "medusa head" in r.output and "eagle-tiny" in r.output
    (shelf / "medusa-tiny" / "config.json").unlink()            # no medusa head for this target any more
    with pytest.raises(ConfigError, match="no medusa head ships"):
        Engine(target, method="medusa", k=3)


def test_k_shrinks_the_proposal_to_one_head_or_nothing(medusa16):
    """The K policy's K bounds the work: K = 0 proposes nothing and runs no head, K = 1 a single token from head
    0 alone (a chain), and a step runs only the first min(K, heads) heads."""
    import torch

    from leaplm.heads.loader import load_head_for
    from leaplm.propose.base import ProposeContext
    from leaplm.propose.medusa import MedusaProposer
    from leaplm.sampling import LogitsProcessor

    target = medusa16["target"]
    heads = load_head_for(medusa16["head"], target, kind="medusa")
    calls = [0] * len(heads.net.heads)
    for j, h in enumerate(heads.net.heads):
        h.register_forward_hook(lambda *a, _j=j: calls.__setitem__(_j, calls[_j] + 1))
    prop = MedusaProposer(heads, 64)
    tokens = [1, 2, 3, 4]
    prop.observe_hidden(0, torch.randn(3, target.model.args.hidden_size))            # features of tokens 0..2
    params = SamplingParams(temperature=0)

    def propose(k):
        calls[:] = [0] * len(calls)
        return prop.propose(ProposeContext(tokens, k, params, LogitsProcessor(params), None, None))

    assert propose(0).k == 0 and calls == [0, 0, 0]
    one = propose(1)
    assert one.k == 1 and one.parents is None and calls == [1, 0, 0]
    want = int(torch.nn.functional.linear(heads.net(prop.last)[0], heads.lm_head).argmax())
    assert one.tokens.tolist() == [want]
    two = propose(2)
    assert two.k == 2 and calls == [1, 1, 0]
    assert propose(8).k == 8 and calls == [1, 1, 1]

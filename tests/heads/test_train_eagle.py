"""`leaplm train eagle` on a tiny target: the loss falls within seconds, the run resumes from its checkpoint,
and bad input stops before any work."""
from __future__ import annotations

import json

import pytest

from head_helpers import train_tiny_eagle, write_word_corpus
from leaplm.config import ConfigError
from leaplm.training.eagle import EagleTrainConfig, train_eagle, unroll_mask


def test_loss_falls_and_the_run_resumes(tiny_llama_factory, tmp_path):
    target = tiny_llama_factory(vocab=16, layers=2, seed=3)
    corpus = write_word_corpus(tmp_path / "c.jsonl", 16)
    logs = train_tiny_eagle(target.path, corpus, tmp_path / "h", steps=30)
    first = sum(l.loss for l in logs[:3]) / 3
    last = sum(l.loss for l in logs[-3:]) / 3
    assert last < 0.6 * first, (first, last)                # KL + feature loss of the unrolled passes
    assert logs[-1].agree[0] > 0.3                          # argmax q == argmax p on the train batches
    # resuming to a larger budget continues from step 30 rather than starting again
    more = train_tiny_eagle(target.path, corpus, tmp_path / "h", steps=33)
    assert [l.step for l in more] == [31, 32, 33]
    lines = (tmp_path / "h" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 34))


def test_unroll_mask_is_what_drafting_sees():
    """Pass 2 at position t: the committed context up to t - 1 (pass 1) and itself (pass 2, slot t)."""
    m = unroll_mask(4, 2).int().tolist()
    assert m[2] == [1, 1, 0, 0, 0, 0, 1, 0]
    m3 = unroll_mask(5, 3).int()
    assert m3[4].tolist() == [1, 1, 1, 0, 0] + [0, 0, 0, 1, 0] + [0, 0, 0, 0, 1]


def test_missing_or_empty_data_stops_before_work(tiny_llama_factory, tmp_path, monkeypatch):
    target = tiny_llama_factory(vocab=16, layers=2, seed=3)
    import leaplm.training.eagle as mod

    monkeypatch.setattr(mod, "_load_target", lambda *a: pytest.fail("the target was loaded before the data check"))
    with pytest.raises(FileNotFoundError, match="corpus"):
        train_eagle(EagleTrainConfig(target.path, str(tmp_path / "h"), corpus=str(tmp_path / "nope.jsonl")))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="corpus.*no text"):
        train_eagle(EagleTrainConfig(target.path, str(tmp_path / "h"), corpus=str(tmp_path / "empty.jsonl")))
    with pytest.raises(ConfigError) as e:
        train_eagle(EagleTrainConfig(str(tmp_path), str(tmp_path / "h")))
    assert e.value.field == "target_dir"
    assert not (tmp_path / "h").exists()


def test_cli_refuses_a_missing_target(tmp_path):
    from typer.testing import CliRunner

    from leaplm.cli import app

    r = CliRunner().invoke(app, ["train", "eagle", "--target", str(tmp_path / "x"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--target" in r.output


def test_eval_acceptance_measures_a_head(eagle16):
    """`leaplm eval acceptance --method eagle`: the same rows as for drafts, K being the tree's node budget."""
    from leaplm.training.acceptance import eval_acceptance

    rows = eval_acceptance(eagle16["target"], None, [[1, 2, 3], [4, 5]], ks=(1, 4), temperatures=(0.0, 0.8),
                           max_new_tokens=16, method="eagle", head=eagle16["head"])
    assert [(r.temperature, r.k) for r in rows] == [(0.0, 1), (0.0, 4), (0.8, 1), (0.8, 4)]
    assert all(r.draft_tokens > 0 and 0 <= r.acceptance_rate <= 1 and r.mean_accepted_length >= 1 for r in rows)
    assert rows[0].acceptance_rate > 0                  # the trained head's greedy drafts are taken

"""EAGLE heads over a reduced draft vocabulary: the ids chosen by count, the maps in Speculators' layout, q zero
outside the vocabulary, damaged maps refused; and `train eagle --chat`: ragged chat batches score each row as
the target alone would, the loss covers the answers, and the head trains."""
from __future__ import annotations

import json

import pytest
import torch

from head_helpers import chat_target, train_tiny_eagle, write_chat_prompts
from leaplm.config import ConfigError
from leaplm.heads.loader import load_head_for
from leaplm.heads.vocab import ids_of, maps_of, top_ids
from leaplm.numerics import sum_tolerance


def test_top_ids_rank_by_count_then_prior_and_maps_round_trip():
    counts = torch.tensor([0, 5, 0, 9, 1, 0, 5, 0])
    prior = torch.tensor([0, 0, 7, 0, 0, 3, 0, 1])
    ids = top_ids(counts, 5, prior)
    assert ids.tolist() == [1, 2, 3, 4, 6]          # counts 9, 5, 5, 1, then the prior's best unseen token (2)
    d2t, t2d = maps_of(ids, 8)
    assert d2t.tolist() == [1, 1, 1, 1, 2]          # offsets: target id = draft row + d2t
    assert t2d.tolist() == [False, True, True, True, True, False, True, False]
    assert ids_of(d2t, t2d, 8).tolist() == ids.tolist()
    with pytest.raises(ConfigError, match="draft_vocab"):
        top_ids(counts, 9)


@pytest.mark.parametrize("damage,match", [("outside", "outside"), ("repeat", "two draft rows"),
                                          ("t2d", "disagree")])
def test_damaged_maps_are_refused(eagle16, tmp_path, damage, match):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "h"
    shutil.copytree(eagle16["reduced"], d)
    w = load_file(str(d / "model.safetensors"))
    if damage == "outside":
        w["d2t"][-1] = 100
    elif damage == "repeat":
        w["d2t"][1] = w["d2t"][0] - 1               # row 1 -> the same target id as row 0
    else:
        w["t2d"] = ~w["t2d"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match=match):
        load_head_for(str(d), eagle16["target"])


def test_q_is_zero_outside_the_draft_vocabulary(eagle16):
    """The head scores its 6 rows only; over the 16 tokens its logits are -inf (q = 0) outside them."""
    head = load_head_for(eagle16["reduced"], eagle16["target"])
    ids = head.vocab_ids
    assert ids.numel() == 6
    rows = head.logits(torch.randn(5, head.embed.shape[1]))                    # [5, 6]
    assert rows.shape == (5, 6) and torch.isfinite(rows).all()
    logits = head.to_vocab(rows, float("-inf"))                                 # [5, 16]
    outside = torch.ones(16, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[:, outside]).all() and torch.equal(logits[:, ids], rows)
    assert torch.softmax(logits, -1)[:, outside].sum() == 0
    assert head.token_ids(torch.arange(6)).tolist() == ids.tolist()


@pytest.fixture(scope="module")
def chat16(tiny_llama_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("chat16")
    from leaplm.models import load_model

    return load_model(chat_target(tiny_llama_factory(vocab=16, layers=2, seed=3).path, d / "target"))


def test_chat_batch_scores_each_row_as_alone(chat16):
    """Ragged prompts decoded together: each row's tokens, features and log-normaliser equal the target run on
    that row alone; the loss mask covers the answer (up to the first EOS) and nothing else."""
    from leaplm.training.eagle import target_batch
    from leaplm.training.eagle_chat import chat_target_batch

    model = chat16.model
    prompts = [[1, 5, 7, 2, 3], [1, 4, 2, 3], [1, 9, 9, 9, 11, 6, 2, 3]]
    free = chat_target_batch(model, prompts, 10, 0.0, torch.Generator(), eos_ids=set())
    eos = int(free.ids[1, len(prompts[1]) + 3])     # row 1's 4th answer token ends its answer below
    b = chat_target_batch(model, prompts, 10, 0.0, torch.Generator(), eos_ids={eos})
    tol = sum_tolerance(torch.float32, 2 * 64 + 32, float(free.feats.abs().max()) + 1)
    for r, p in enumerate(prompts):
        alone = target_batch(model, torch.tensor([p]), 10, 0.0, torch.Generator())   # ids [1, P + 9]
        n = len(p) + 9
        assert free.ids[r, :n].tolist() == alone.ids[0].tolist()
        assert torch.allclose(free.feats[r, :n], alone.feats[0], atol=tol)
        assert torch.allclose(free.lse[r, :n], alone.lse[0], atol=tol * 10)
        assert free.loss_mask[r].nonzero().flatten().tolist() == list(range(len(p), n))
        stop = (free.ids[r, len(p):n] == eos).nonzero()           # the answer ends at its first EOS, whose
        end = len(p) + int(stop[0]) if len(stop) else n           # own feature predicts nothing and is dropped
        assert b.loss_mask[r].nonzero().flatten().tolist() == list(range(len(p), end)), r


def test_chat_training_with_a_draft_vocabulary(chat16, tmp_path):
    prompts = write_chat_prompts(tmp_path / "p.jsonl", 16)
    logs = train_tiny_eagle(chat16.path, prompts, tmp_path / "h", steps=30, chat=True, draft_vocab=8,
                            prompt_tokens=16)
    first = sum(l.loss for l in logs[:3]) / 3
    last = sum(l.loss for l in logs[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    ev = [l.eval_accept for l in logs if l.eval_accept]
    assert ev and ev[-1][0] > ev[0][0]              # held-out acceptance (1 - TV on the 8 ids) rises
    meta = json.loads((tmp_path / "h" / "config.json").read_text())
    assert meta["head"]["draft_vocab_size"] == 8 and 0 < meta["draft_vocab_coverage"] <= 1
    head = load_head_for(str(tmp_path / "h"), chat16)
    assert head.lm_head.shape == (8, 32) and head.vocab_ids.numel() == 8


def test_chat_and_vocab_bad_input_stops_before_work(chat16, tmp_path, monkeypatch):
    import leaplm.training.eagle as mod
    from leaplm.training.eagle import EagleTrainConfig, train_eagle

    monkeypatch.setattr(mod, "_load_target", lambda *a: pytest.fail("the target was loaded before the data check"))
    out = str(tmp_path / "h")
    with pytest.raises(ConfigError, match="corpus"):
        train_eagle(EagleTrainConfig(chat16.path, out, corpus=str(tmp_path / "nope.jsonl"), chat=True))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no prompt"):
        train_eagle(EagleTrainConfig(chat16.path, out, corpus=str(tmp_path / "empty.jsonl"), chat=True))
    (tmp_path / "bad.jsonl").write_text('{"answer": "x"}\n')
    with pytest.raises(ConfigError, match="line 1"):
        train_eagle(EagleTrainConfig(chat16.path, out, corpus=str(tmp_path / "bad.jsonl"), chat=True))
    with pytest.raises(ConfigError, match="draft_vocab"):
        train_eagle(EagleTrainConfig(chat16.path, out, kind="medusa", draft_vocab=8))
    with pytest.raises(ConfigError, match="corpus_fraction"):
        train_eagle(EagleTrainConfig(chat16.path, out, chat=True, corpus_fraction=0.5))

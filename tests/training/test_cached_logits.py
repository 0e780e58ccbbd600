"""On-policy distillation from cached target logits: the shards, the loss, and a run that trains on them."""
import json
import random

import pytest
import torch
from safetensors import safe_open

from leaplm.config import ConfigError
from leaplm.training.distill import cached_loss, distill
from leaplm.training.logit_shards import LogitShards
from leaplm.training.ondata import generate_target_logits

N_FILES = 20  # as conftest.py

NEW = 6


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, tiny_target_dir):
    d = tmp_path_factory.mktemp("logits")
    # two parts fill one directory, as two processes would
    for part in (0, 1):
        generate_target_logits(str(tiny_target_dir), d, n_seqs=12, new_tokens=NEW, top_k=8, batch_size=4,
                               prompt_lengths=(16, 24), part=part, parts=2, max_files=N_FILES)
    return d


def test_shards_hold_greedy_continuations_and_their_top_k(shard_dir, tiny_target_dir):
    from transformers import AutoModelForCausalLM

    paths = sorted(shard_dir.glob("shard-*.safetensors"))
    assert [p.name for p in paths] == [f"shard-s0-0000{i}.safetensors" for i in range(3)]
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.bfloat16).eval()
    for i, p in enumerate(paths):
        with safe_open(str(p), "pt") as f:
            P = int(f.metadata()["prompt_tokens"])
            ids, top_ids, top_lp = (f.get_tensor(k) for k in ("input_ids", "topk_ids", "topk_logp"))
        assert P == (16, 24)[i % 2]
        assert ids.shape == (4, P + NEW) and top_ids.shape == top_lp.shape == (4, NEW, 8)
        # column 0 is the greedy choice, i.e. the token that follows; log-probs are sorted and <= 0
        assert torch.equal(top_ids[:, :, 0].long(), ids[:, P:].long())
        assert (top_lp[..., :-1] >= top_lp[..., 1:]).all() and (top_lp <= 0).all()
        # and they are the target's own: recompute position P + 2 by a plain forward
        with torch.no_grad():
            lp = target(input_ids=ids[:, : P + 2].long()).logits[:, -1].float().log_softmax(-1)   # [4, V]
        assert torch.equal(lp.topk(8).indices[:, 0], top_ids[:, 2, 0].long())
        assert torch.allclose(lp.topk(8).values, top_lp[:, 2].float(), atol=0.08)


def test_generation_resumes_without_redoing_shards(shard_dir, tiny_target_dir):
    before = {p.name: p.stat().st_mtime_ns for p in shard_dir.glob("shard-*")}
    rows = generate_target_logits(str(tiny_target_dir), shard_dir, n_seqs=12, new_tokens=NEW, top_k=8, batch_size=4,
                                  prompt_lengths=(16, 24), max_files=N_FILES)
    assert rows == 12
    assert {p.name: p.stat().st_mtime_ns for p in shard_dir.glob("shard-*")} == before


def test_loader_keeps_a_validation_shard_and_batches_one_length(shard_dir):
    s = LogitShards.load(shard_dir)
    assert len(s.train) == 2 and len(s.valid) == 1
    assert s.train_tokens == 2 * 4 * NEW
    b = s.batch(random.Random(0), 3)
    assert b.input_ids.shape == (3, b.prompt_tokens + NEW) and b.topk_ids.dtype == torch.long


def test_cached_loss_is_zero_only_for_the_target_itself():
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(2, 4, 9, generator=g)               # [batch, new, vocab]; k = vocab keeps all of p
    logp, ids = p_logits.log_softmax(-1).topk(9, dim=-1)
    same = cached_loss(p_logits, ids, logp, alpha=1.0)
    assert same.kl.abs() < 1e-5 and same.agree == 1.0
    other = cached_loss(torch.randn(2, 4, 9, generator=g), ids, logp, alpha=0.25)
    assert other.kl > 1e-2 and other.agree < 1.0
    # CE is on the target's greedy token (column 0)
    q = torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(1))
    r = cached_loss(q, ids, logp, alpha=0.25)
    ref_ce = torch.nn.functional.cross_entropy(q.reshape(-1, 9), ids[..., 0].reshape(-1))
    assert torch.allclose(r.ce, ref_ce, atol=1e-5)
    assert torch.allclose(r.loss, 0.25 * r.kl + 0.75 * r.ce, atol=1e-6)


def test_distill_on_cached_logits_never_runs_the_target(tmp_path, shard_dir, tiny_target_dir, tiny_draft_dir,
                                                        distill_config, monkeypatch):
    from transformers import AutoModelForCausalLM

    import leaplm.training.distill as distill_mod

    monkeypatch.setattr(distill_mod, "target_logprobs", lambda *a, **k: pytest.fail("target was run"))
    out = tmp_path / "cached"
    cfg = distill_config(out, tiny_target_dir, tiny_draft_dir, logits_dir=str(shard_dir), batch_size=2,
                         tokens=5 * 2 * NEW, eval_every=5)
    seen = []
    last = distill(cfg, seen.append)
    assert [s.step for s in seen] == [1, 2, 3, 4, 5]
    assert all(s.agree is not None and 0 <= s.agree <= 1 for s in seen)
    assert last.eval_agree is not None and last.eval_kl is not None
    assert last.tokens_seen == 5 * 2 * NEW
    m = AutoModelForCausalLM.from_pretrained(out)
    assert m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
    rec = json.loads((out / "train_config.json").read_text())
    assert rec["logits_dir"] == str(shard_dir) and rec["target_n_params"] > 0


def test_bad_logits_dir_names_the_field(tmp_path, tiny_target_dir, tiny_draft_dir, distill_config):
    with pytest.raises(ConfigError) as e:
        distill_config(tmp_path / "o", tiny_target_dir, tiny_draft_dir, logits_dir=str(tmp_path / "none")).validate()
    assert e.value.field == "logits_dir"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="logits_dir"):
        distill(distill_config(tmp_path / "o", tiny_target_dir, tiny_draft_dir, logits_dir=str(tmp_path / "empty")))

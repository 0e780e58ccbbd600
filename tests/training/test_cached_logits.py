"""On-policy distillation from cached target logits: the shards, the loss, and a run that trains on them."""
import json
import random

import pytest
import torch
from safetensors import safe_open

from leaplm.config import ConfigError
from leaplm.training.distill import cached_loss, distill, eval_cached, tempered_divergence
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


# ---- sampled continuations and tempered full-distribution losses ---------------------------------------------

@pytest.fixture(scope="module")
def sampled_dir(tmp_path_factory, tiny_target_dir):
    d = tmp_path_factory.mktemp("sampled")
    generate_target_logits(str(tiny_target_dir), d, n_seqs=12, new_tokens=NEW, top_k=8, batch_size=4,
                           prompt_lengths=(16, 24), max_files=N_FILES, temperature=1.5, seed=5)
    return d


def _read(path):
    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in ("input_ids", "topk_ids", "topk_logp")}


def test_sampled_shards_hold_sampled_tokens_and_raw_log_probs(sampled_dir, tiny_target_dir):
    from transformers import AutoModelForCausalLM

    paths = sorted(sampled_dir.glob("shard-*.safetensors"))
    assert [p.name for p in paths] == [f"shard-s5-t1.5-0000{i}.safetensors" for i in range(3)]
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    off_argmax = 0
    for p in paths:
        meta, t = _read(p)
        P = int(meta["prompt_tokens"])
        assert meta["temperature"] == "1.5" and meta["seed"] == "5"
        off_argmax += int((t["topk_ids"][:, :, 0].long() != t["input_ids"][:, P:].long()).sum())
        # the stored log-probs are the raw (T = 1) ones at the positions the sampled tokens lead to
        with torch.no_grad():
            lp = target(input_ids=t["input_ids"][:, : P + 3].long()).logits[:, -1].log_softmax(-1)   # [4, V]
        assert torch.equal(lp.topk(8).indices, t["topk_ids"][:, 3].long())
        assert torch.allclose(lp.topk(8).values, t["topk_logp"][:, 3].float(), atol=1e-2)
    # sampling at T = 1.5 from a barely trained 512-token model leaves the argmax on most of the 72 positions
    assert off_argmax > 12


def test_sampled_shards_are_seeded_per_shard(sampled_dir, tiny_target_dir, tmp_path):
    # written by two processes, or resumed, a shard holds the same draws; another seed draws others
    for part in (0, 1):
        generate_target_logits(str(tiny_target_dir), tmp_path / "a", n_seqs=12, new_tokens=NEW, top_k=8,
                               batch_size=4, prompt_lengths=(16, 24), max_files=N_FILES, temperature=1.5, seed=5,
                               part=part, parts=2)
    for p in sorted(sampled_dir.glob("shard-*")):
        assert torch.equal(_read(p)[1]["input_ids"], _read(tmp_path / "a" / p.name)[1]["input_ids"])
    generate_target_logits(str(tiny_target_dir), tmp_path / "b", n_seqs=4, new_tokens=NEW, top_k=8, batch_size=4,
                           prompt_lengths=(16, 24), max_files=N_FILES, temperature=1.5, seed=6)
    a, b = _read(sampled_dir / "shard-s5-t1.5-00000.safetensors")[1], _read(tmp_path / "b" / "shard-s6-t1.5-00000.safetensors")[1]
    assert not torch.equal(a["input_ids"], b["input_ids"])


def _full_tv(p_logits, q_logits, t):
    return 0.5 * ((p_logits / t).softmax(-1) - (q_logits / t).softmax(-1)).abs().sum(-1)   # [batch, new]


def test_tempered_divergence_matches_the_full_distribution_when_k_is_the_vocabulary():
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(2, 5, 11, generator=g) * 3, torch.randn(2, 5, 11, generator=g) * 3
    logp, ids = p_logits.log_softmax(-1).topk(11, dim=-1)
    for t in (0.5, 0.8, 1.0, 2.0):
        d = tempered_divergence(q_logits, ids, logp, t)
        assert torch.allclose(d.tv, _full_tv(p_logits, q_logits, t), atol=1e-5)
        lp, lq = (p_logits / t).log_softmax(-1), (q_logits / t).log_softmax(-1)
        assert torch.allclose(d.kl, (lp.exp() * (lp - lq)).sum(-1), atol=1e-5)
        same = tempered_divergence(p_logits, ids, logp, t)
        assert same.tv.abs().max() < 1e-5 and same.kl.abs().max() < 1e-5
    # a sharpened copy of p (logits doubled) has every argmax right, yet sampling at T = 1 would reject it often
    sharp = tempered_divergence(2 * p_logits, ids, logp, 1.0)
    assert sharp.tv.mean() > 0.05
    assert torch.allclose(sharp.tv, _full_tv(p_logits, 2 * p_logits, 1.0), atol=1e-5)


def test_tv_counts_the_mass_q_puts_outside_the_top_k():
    p_logits = torch.tensor([[[5.0, 4.0, 0.0, 0.0, 0.0, 0.0]]])         # [1, 1, 6]: p's top 2 hold ~all mass
    logp, ids = p_logits.log_softmax(-1).topk(2, dim=-1)
    q_outside = torch.tensor([[[-9.0, -9.0, 9.0, 0.0, 0.0, 0.0]]])      # q almost all on token 2
    assert tempered_divergence(q_outside, ids, logp, 1.0).tv.item() > 0.99
    assert tempered_divergence(p_logits, ids, logp, 1.0).tv.item() < 0.02   # ~ p's own tail, dropped from p_k


def test_default_cached_loss_is_the_greedy_recipe():
    g = torch.Generator().manual_seed(2)
    p_logits, q = torch.randn(2, 4, 13, generator=g), torch.randn(2, 4, 13, generator=g)
    logp, ids = p_logits.log_softmax(-1).topk(5, dim=-1)
    r = cached_loss(q, ids, logp, alpha=0.5)
    lp_k = logp.log_softmax(-1)
    ref_kl = (lp_k.exp() * (lp_k - q.log_softmax(-1).gather(-1, ids))).sum(-1).mean()
    assert torch.allclose(r.kl, ref_kl, atol=1e-6)
    tv = cached_loss(q, ids, logp, alpha=1.0, loss="tv", temperatures=(0.8, 1.0))
    ref_tv = (tempered_divergence(q, ids, logp, 0.8).tv.mean() + tempered_divergence(q, ids, logp, 1.0).tv.mean()) / 2
    assert torch.allclose(tv.loss, ref_tv, atol=1e-6) and torch.allclose(tv.overlap, 1 - ref_tv, atol=1e-6)


@pytest.mark.parametrize("loss", ["kl", "tv"])
def test_tempered_distillation_raises_the_sampled_overlap(tmp_path, sampled_dir, shard_dir, tiny_target_dir,
                                                          tiny_draft_dir, distill_config, loss):
    import shutil

    from transformers import AutoModelForCausalLM

    mixed = tmp_path / "mixed"                         # greedy and sampled shards in one directory
    mixed.mkdir()
    for p in [*shard_dir.glob("shard-*"), *sampled_dir.glob("shard-*")]:
        shutil.copy(p, mixed / p.name)
    cfg = distill_config(tmp_path / loss, tiny_target_dir, tiny_draft_dir, logits_dir=str(mixed), batch_size=4,
                         tokens=30 * 4 * NEW, eval_every=30, lr=1e-2, alpha=1.0, loss=loss, temperatures=(0.8, 1.0))
    shards = LogitShards.load(mixed)
    before = eval_cached(AutoModelForCausalLM.from_pretrained(tiny_draft_dir), shards, cfg, 4)
    last = distill(cfg)
    assert last.eval_overlap > before.overlap + 0.05, (before, last)
    assert json.loads((tmp_path / loss / "train_config.json").read_text())["temperatures"] == [0.8, 1.0]
    # the model card names the loss, the temperatures and the kinds of continuations
    from leaplm.training.modelcard import write_model_card

    text = write_model_card(tmp_path / loss).read_text()
    d = "KL(p_T,k \\|\\| q_T)" if loss == "kl" else "TV(p_T,k, q_T)"     # tables escape |
    for needle in (f"1.0 * mean over T in {{0.8, 1}} of {d}", "greedy: 3 shards", "sampled at T = 1.5: 3 shards",
                   "final sampled overlap"):
        assert needle in text, needle

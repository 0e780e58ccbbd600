import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from leaplm.config import ConfigError
from leaplm.training.corpus import corpus_texts
from leaplm.training.distill import distill, distill_loss
from leaplm.training.presets import llama_config
from leaplm.training.pretrain import load_tokenizer, save_hf
from leaplm.training.tokenizer import train_tokenizer


def _log_steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


def test_end_to_end_checkpoint_loads_and_generates(tmp_path, tiny_target_dir, tiny_draft_dir, distill_config):
    """tokenizer -> pretrained target and CE draft (fixtures) -> distill from the draft -> plain HF use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seen = []
    last = distill(distill_config(tmp_path / "distilled", tiny_target_dir, tiny_draft_dir, steps=4), seen.append)
    assert [s.step for s in seen] == [1, 2, 3, 4]
    assert last.eval_loss is not None and last.eval_kl is not None and last.kl >= 0

    out = tmp_path / "distilled"
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(tiny_target_dir).config.vocab_size
    ids = tok("def main():\n", return_tensors="pt").input_ids  # [1, n]
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert gen.shape == (1, ids.shape[1] + 5)
    assert isinstance(tok.decode(gen[0]), str)
    cfg = json.loads((out / "train_config.json").read_text())
    assert cfg["kind"] == "distill" and cfg["draft_init"] == str(tiny_draft_dir)


def test_distill_from_preset_and_resume(tmp_path, tiny_target_dir, distill_config):
    out = tmp_path / "run"
    distill(distill_config(out, tiny_target_dir, "tiny", steps=3, save_every=1))
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 3

    seen = []
    distill(distill_config(out, tiny_target_dir, "tiny", steps=5, save_every=1), seen.append)
    assert [s.step for s in seen] == [4, 5]
    assert _log_steps(out) == [1, 2, 3, 4, 5]

    # a finished budget is a no-op
    assert distill(distill_config(out, tiny_target_dir, "tiny", steps=5)) is None


def test_refuses_vocab_mismatch_naming_both_sizes(tmp_path, tiny_target_dir):
    from transformers import LlamaForCausalLM

    from leaplm.training.distill import DistillConfig

    other_tok = train_tokenizer(corpus_texts("stdlib", "train", 5), tmp_path / "tok400", vocab_size=400)
    draft = LlamaForCausalLM(llama_config("tiny", vocab_size=len(other_tok), eos_id=other_tok.eos_token_id))
    save_hf(draft, other_tok, tmp_path / "draft400")
    target_vocab = len(load_tokenizer(str(tiny_target_dir)))
    assert target_vocab != 400

    cfg = DistillConfig(target_dir=str(tiny_target_dir), out_dir=str(tmp_path / "out"),
                        draft_init=str(tmp_path / "draft400"), tokens=256, batch_size=4, seq_len=64, max_files=5)
    with pytest.raises(ValueError, match=rf"draft vocab_size 400 != target vocab_size {target_vocab}"):
        distill(cfg)
    assert not (tmp_path / "out" / "train_state.pt").exists()


def test_refuses_same_size_different_tokenizer(tmp_path, tiny_target_dir):
    from transformers import LlamaForCausalLM

    from leaplm.training.distill import DistillConfig

    target_vocab = len(load_tokenizer(str(tiny_target_dir)))
    # same size, trained on other files: different merges
    other = train_tokenizer(corpus_texts("stdlib", "train")[200:220], tmp_path / "tok", vocab_size=target_vocab)
    assert len(other) == target_vocab
    draft = LlamaForCausalLM(llama_config("tiny", vocab_size=len(other), eos_id=other.eos_token_id))
    save_hf(draft, other, tmp_path / "draft")
    cfg = DistillConfig(target_dir=str(tiny_target_dir), out_dir=str(tmp_path / "out"),
                        draft_init=str(tmp_path / "draft"), tokens=256, batch_size=4, seq_len=64, max_files=5)
    with pytest.raises(ConfigError, match="tokenizer differs"):
        distill(cfg)


@pytest.mark.parametrize("field,value", [("alpha", 1.5), ("tokens", 0), ("draft_init", "no-such-preset"),
                                         ("target_dir", "/nonexistent")])
def test_config_errors_name_the_field(tmp_path, tiny_target_dir, distill_config, field, value):
    cfg = dataclasses.replace(distill_config(tmp_path / "out", tiny_target_dir, "tiny"), **{field: value})
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert e.value.field == field


def test_out_dir_must_differ_from_draft_init(tiny_target_dir, tiny_draft_dir, distill_config):
    # the draft's pretraining train_state.pt would otherwise be "resumed" as a distillation state
    with pytest.raises(ConfigError, match="out_dir"):
        distill_config(tiny_draft_dir, tiny_target_dir, tiny_draft_dir).validate()


def _reference_kl(p_logits, q_logits):
    """Slow and obvious: sum_v p(v) (log p(v) - log q(v)), averaged over positions."""
    p = p_logits.softmax(-1)
    return (p * (p.log() - q_logits.log_softmax(-1))).sum(-1).mean()


def test_distill_loss_matches_reference():
    g = torch.Generator().manual_seed(0)
    q_logits = torch.randn(2, 5, 11, generator=g)  # [batch, seq, vocab]
    p_logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)  # [batch, seq]
    logp = p_logits.log_softmax(-1)
    r = distill_loss(q_logits, logp, ids, alpha=0.3)
    ref_ce = F.cross_entropy(q_logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert torch.allclose(r.kl, _reference_kl(p_logits, q_logits), atol=1e-5)
    assert torch.allclose(r.ce, ref_ce, atol=1e-5)
    assert torch.allclose(r.loss, 0.3 * r.kl + 0.7 * r.ce, atol=1e-6)
    # negative control: q == p gives zero KL, a different q does not
    assert distill_loss(p_logits, logp, ids, 1.0).kl.abs() < 1e-5
    assert r.kl > 1e-2

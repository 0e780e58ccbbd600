"""`train draft` for a base Gemma 3 target (a GGUF file or its checkpoint): continuation prompts (no chat template),
a cut draft of the target's own Gemma layers (not a llama), saved as a reduced-vocabulary Gemma directory the
engine loads natively and runs losslessly behind its target."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.training import corpus, text_prompts
from leaplm.training.chat_draft_init import build_cut_draft
from leaplm.training.draft_run import DraftRunConfig, train_draft
from leaplm.training.text_prompts import continuation_prompts

from perturb import perturb_

# llama.cpp's gemma3 shape (every sixth layer global, sliding layers at base 10000, head_dim ** -0.5): the file
# then reads back as the checkpoint it came from
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=512, initializer_range=0.3, sliding_window=8, rope_theta=1e6,
             rope_local_base_freq=1e4, query_pre_attn_scalar=8)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, byte_tokenizer) -> dict:
    from leaplm.models.gguf_export import export_gguf

    d = tmp_path_factory.mktemp("gemma_base")
    eos = byte_tokenizer.eos_token_id
    cfg = transformers.Gemma3TextConfig(vocab_size=len(byte_tokenizer), eos_token_id=eos, bos_token_id=eos,
                                        pad_token_id=0, **SHAPE)
    torch.manual_seed(5)
    model = transformers.Gemma3ForCausalLM(cfg)
    perturb_(model, 5)                       # norms 1 + noise: a norm read as w instead of 1 + w shows
    model.save_pretrained(str(d / "hf"))
    byte_tokenizer.save_pretrained(str(d / "hf"))
    return {"hf": str(d / "hf"), "gguf": str(export_gguf(str(d / "hf"), str(d / "t.gguf"), "f32").path)}


def run_config(target, out, **kw) -> DraftRunConfig:
    base = dict(target=target, out_dir=str(out), shape="cut-2", draft_vocab=64, prompts="text", n_prompts=6,
                new_tokens=8, top_k=4, max_prompt_tokens=400, batch_size_data=3, shard_rows=3, steps=3,
                batch_size=2, warmup_steps=1, save_every=3, eval_every=3, max_files=20, threads=1)
    return DraftRunConfig(**(base | kw))


def test_continuation_prompts_alternate_code_and_prose_from_the_training_split(monkeypatch):
    splits = []
    real = corpus.stdlib_files

    def spy(split="train"):
        splits.append(split)
        return real(split)

    monkeypatch.setattr(corpus, "stdlib_files", spy)
    monkeypatch.setattr(text_prompts, "stdlib_files", spy)
    a = continuation_prompts(seed=0, max_files=40)
    assert splits and set(splits) == {"train"}                     # the held-out modules are never read
    code = [p for p in a[:20] if p.rstrip().endswith(":") and "def " in p.splitlines()[-1]]
    assert 0 < len(code) < 20                                       # both kinds in any prefix
    assert all(p.rstrip().endswith(".") for p in a[:20] if p not in code)
    assert a == continuation_prompts(seed=0, max_files=40)
    assert a != continuation_prompts(seed=1, max_files=40)


def test_cut_of_a_gemma_gguf_is_the_targets_own_gemma_layers(gemma):
    d2t = torch.cat([torch.tensor([-1]), torch.arange(3, 40)])     # 38 rows: "other" + target ids 3..39
    from_file = build_cut_draft(gemma["gguf"], 2, d2t, eos_target=0)
    from_dir = build_cut_draft(gemma["hf"], 2, d2t, eos_target=0)
    assert type(from_file).__name__ == "Gemma3ForCausalLM" and from_file.config.num_hidden_layers == 2
    assert from_file.config.layer_types == ["sliding_attention"] * 2
    assert from_file.model.embed_tokens.weight.data_ptr() == from_file.lm_head.weight.data_ptr()
    a, b = from_file.state_dict(), from_dir.state_dict()
    assert a.keys() == b.keys()
    for k in a:       # the file stores norms as 1 + w in fp32, read back as (1 + w) - 1: a rounding apart
        torch.testing.assert_close(a[k], b[k], atol=2 * torch.finfo(torch.float32).eps, rtol=0, msg=k)
    # the draft computes the target's first two layers: its hidden state after them equals the full model's
    full = transformers.AutoModelForCausalLM.from_pretrained(gemma["hf"]).eval()
    ids = torch.tensor([[5, 9, 3, 17, 22, 9, 5, 30]])
    with torch.no_grad():
        hs = full.model(input_ids=ids, output_hidden_states=True).hidden_states
        t2d = torch.zeros(full.config.vocab_size, dtype=torch.long)
        t2d[3:40] = torch.arange(1, 38)
        got = from_dir.model(input_ids=t2d[ids]).last_hidden_state                       # [1, T, H]
        want = full.model.norm(hs[2])               # after layer 2, through the final norm as the draft's last state
        later = full.model.norm(hs[3])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, later, atol=1e-2)               # negative control: one layer later differs


def test_base_model_run_makes_a_lossless_gemma_draft(gemma, tmp_path):
    with pytest.raises(ConfigError, match="chat template") as e:    # chat answers need a template this one lacks
        train_draft(run_config(gemma["gguf"], tmp_path / "chat", prompts="chat"))
    assert e.value.field == "target"
    with pytest.raises(ConfigError) as e:
        train_draft(run_config(gemma["gguf"], tmp_path / "bad", prompts="poems"))
    assert e.value.field == "prompts"
    # the run reads the checkpoint directory: the GGUF file's converted tokenizer gains two special tokens past
    # this tiny model's rows, which the engine refuses to pair with any draft (the cut from the file is the same
    # cut, as the test above shows)
    out = tmp_path / "run"
    assert train_draft(run_config(gemma["hf"], out)).step == 3
    cfg = json.loads((out / "draft" / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 64
    prompt = [5, 9, 3, 17, 22, 9, 5, 30, 5, 9]
    outs = {}
    for method in ("none", "draft"):
        eng = Engine(gemma["hf"], method=method, draft=str(out / "draft") if method == "draft" else None,
                     backend="torch", k=3, adaptive_k=False)
        outs[method] = eng.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0))
    assert outs["draft"].token_ids == outs["none"].token_ids
    assert outs["draft"].stats.draft_tokens > 0


def test_bos_is_a_draft_row_and_text_windows_start_with_it():
    from types import SimpleNamespace

    from leaplm.models.draft_vocab import t2d_table
    from leaplm.training.chat_distill import text_ce
    from leaplm.training.chat_shards import choose_vocab

    mass = torch.tensor([0.0, 0.3, 0.2, 0.1, 0.25, 0.15, 0.0, 0.0])         # BOS (7) is never emitted
    assert 7 not in choose_vocab([], 4, 8, mass).tolist()                     # negative control
    d2t = choose_vocab([], 4, 8, mass, keep=(7,))
    assert d2t.tolist()[:2] == [-1, 7] and len(d2t) == 4
    seen = []

    def draft(input_ids):                                                     # records what the draft reads
        seen.append(input_ids)
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 4))

    t2d = t2d_table(d2t, 8)
    x = torch.tensor([[1, 4, 1, 4], [4, 1, 4, 1]])                           # [B, S] target ids
    text_ce(draft, x, t2d, bos=7)
    assert seen[0].shape == (2, 4) and (seen[0][:, 0] == t2d[7]).all()
    assert seen[0][:, 1:].tolist() == t2d[x[:, :-1]].tolist()
    text_ce(draft, x, t2d)
    assert seen[1].tolist() == t2d[x[:, :-1]].tolist()                      # without BOS: the text as it is


def test_max_context_keeps_the_first_token_and_the_prompts_end():
    from leaplm.training.chat_distill import make_batch
    from leaplm.training.chat_shards import ChatRow

    ids = torch.arange(2, 16)                                                 # prompt 2..11 (P = 10), answer 12..15
    row = ChatRow(ids, 10, torch.stack([ids[10:], ids[10:] - 1], 1), torch.zeros(4, 2))
    t2d = torch.arange(20)
    full, cut = make_batch([row], t2d), make_batch([row], t2d, max_context=3)
    assert cut.inputs.tolist() == [[2, 9, 10, 11, 12, 13, 14]]               # BOS, the last 3 prompt tokens, answer
    assert torch.equal(cut.inputs[0, cut.where[:, 1]], full.inputs[0, full.where[:, 1]])   # same positions scored
    assert torch.equal(cut.emitted, full.emitted) and torch.equal(cut.topk, full.topk)
    assert make_batch([row], t2d, max_context=9).inputs.tolist() == full.inputs.tolist()   # nothing to cut

"""Chat distillation for any target: prompts from the stdlib, the target's answers through leaplm's batched
engine with top-k log-probs (train chatdata), a reduced-vocabulary draft trained on them (train distill-chat),
and that draft matched to its target by tokenizer and lossless behind it."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import embedded, load_model
from leaplm.models.draft_vocab import VocabMappedDraft, read_d2t
from leaplm.training.chat_distill import ChatDistillConfig, distill_chat
from leaplm.training.chat_ondata import ChatDataConfig, generate_chat_logits
from leaplm.training.chat_prompts import KINDS, chat_prompts

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory, checkpoint):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("chat_target")
    shutil.copytree(checkpoint("llama_tied"), d, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    return str(d)


def data_config(model, out, **kw) -> ChatDataConfig:
    base = dict(model=model, out_dir=str(out), n_prompts=8, new_tokens=10, top_k=5, batch_size=3, shard_rows=4,
                temperatures=(0.0, 0.8), max_prompt_tokens=200, max_files=20)
    return ChatDataConfig(**(base | kw))


@pytest.fixture(scope="module")
def shards(tmp_path_factory, chat_target):
    out = tmp_path_factory.mktemp("chat_shards")
    generate_chat_logits(data_config(chat_target, out))
    return out


def test_prompts_cover_three_kinds_reproducibly():
    a = chat_prompts(seed=0, max_files=30)
    assert {p.kind for p in a[:30]} == set(KINDS)
    assert [p.text for p in a] == [p.text for p in chat_prompts(seed=0, max_files=30)]
    assert [p.text for p in a] != [p.text for p in chat_prompts(seed=1, max_files=30)]
    assert all(p.text.startswith("Write a Python function `") for p in a if p.kind == "code")
    assert all("```python\n" in p.text for p in a if p.kind == "edit")


def test_shards_hold_the_engines_own_answers(shards, chat_target):
    from leaplm.models.tokens import chat_prompt, encode_prompt

    paths = sorted(shards.glob("chat-*.safetensors"))
    assert [p.name for p in paths] == ["chat-00000.safetensors", "chat-00001.safetensors"]
    s = load_file(str(paths[0]))                                       # temperature 0: greedy answers
    engine = Engine(chat_target, method="none")
    prompts = [p for p in chat_prompts(0, 20)
               if len(encode_prompt(engine.tokenizer, chat_prompt(engine.tokenizer, p.text),
                                    engine.target.bos_id)) <= 200]
    for r in range(4):
        P, N = int(s["prompt_len"][r]), int(s["answer_len"][r])
        ids = encode_prompt(engine.tokenizer, chat_prompt(engine.tokenizer, prompts[r].text), engine.target.bos_id)
        assert s["input_ids"][r, :P].tolist() == ids
        ref = engine.generate(ids, SamplingParams(max_new_tokens=10, temperature=0, logprobs=5))
        assert s["input_ids"][r, P : P + N].tolist() == ref.token_ids
        assert s["topk_ids"][r, :N, 0].tolist() == ref.token_ids         # greedy: the emitted token is the argmax
        want = torch.tensor([[v for _, v in lp.top] for lp in ref.logprobs])
        torch.testing.assert_close(s["topk_logp"][r, :N].float(), want, atol=1e-2, rtol=1e-3)  # stored in fp16
    meta = [__import__("safetensors").safe_open(str(p), "pt").metadata()["temperature"] for p in paths]
    assert meta == ["0.0", "0.8"]


def test_generation_resumes_without_rewriting(shards, chat_target):
    before = {p.name: p.stat().st_mtime_ns for p in shards.glob("chat-*.safetensors")}
    generate_chat_logits(data_config(chat_target, shards))
    assert {p.name: p.stat().st_mtime_ns for p in shards.glob("chat-*.safetensors")} == before


@pytest.fixture(scope="module")
def chat_draft(tmp_path_factory, shards, chat_target):
    out = tmp_path_factory.mktemp("chat_draft")
    cfg = ChatDistillConfig(model=chat_target, logits_dir=str(shards), out_dir=str(out), shape="tiny",
                            draft_vocab=48, steps=3, batch_size=2, warmup_steps=1, eval_every=3, save_every=3,
                            text_weight=0.5, text_max_files=2, text_seq_len=32)
    last = distill_chat(cfg)
    assert last.step == 3 and last.eval_kl is not None
    return str(out)


def test_draft_speaks_the_targets_vocabulary(chat_draft, chat_target):
    drf, tgt = load_model(chat_draft, field="draft"), load_model(chat_target)
    assert isinstance(drf.model, VocabMappedDraft)
    assert drf.model.vocab_size == tgt.model.vocab_size
    d2t = read_d2t(chat_draft)
    assert len(d2t) == 48 and d2t[0] == -1
    cache = drf.model.new_cache(1, 32)
    logits = drf.model(torch.tensor([[5, 6, 7]]), cache)[0, -1]          # [V]
    inside = torch.zeros(tgt.model.vocab_size, dtype=torch.bool)
    inside[d2t[1:]] = True
    assert torch.isinf(logits[~inside]).all() and torch.isfinite(logits[inside]).all()


def test_draft_is_picked_by_tokenizer_and_lossless(chat_draft, chat_target, tmp_path, monkeypatch):
    emb = tmp_path / "embedded"
    shutil.copytree(chat_draft, emb / "chat-draft")
    monkeypatch.setattr(embedded, "EMBEDDED_DIR", emb)
    engine = Engine(chat_target, method="draft", k=3, adaptive_k=False)   # no draft given: matched by tokenizer
    assert engine.spec.method == "draft" and engine.draft.path == str(emb / "chat-draft")
    plain = Engine(chat_target, method="none")
    ids = plain.encode("hello, how are you", SamplingParams())
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    out = engine.generate(ids, greedy)
    assert out.token_ids == plain.generate(ids, greedy).token_ids
    assert out.stats.draft_tokens > 0
    sampled = engine.generate(ids, SamplingParams(max_new_tokens=24, temperature=0.8, seed=3))
    assert len(sampled.token_ids) > 0


def test_cli_chatdata_then_distill_chat(chat_target, tmp_path):
    from typer.testing import CliRunner

    from leaplm.cli import app

    run = CliRunner()
    r = run.invoke(app, ["train", "chatdata", "--model", chat_target, "--out", str(tmp_path / "d"),
                         "--n-prompts", "4", "--shard-rows", "2", "--new-tokens", "6", "--top-k", "3",
                         "--max-prompt-tokens", "200", "--max-files", "20", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "d").glob("chat-*.safetensors"))) == 2
    r = run.invoke(app, ["train", "distill-chat", "--model", chat_target, "--logits-dir", str(tmp_path / "d"),
                         "--out", str(tmp_path / "m"), "--shape", "tiny", "--draft-vocab", "32", "--steps", "2",
                         "--batch-size", "1", "--warmup-steps", "1", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "m" / "draft_vocab.safetensors").is_file()
    r = run.invoke(app, ["train", "distill-chat", "--model", chat_target, "--logits-dir", str(tmp_path / "d"),
                         "--out", str(tmp_path / "m2"), "--shape", "huge"])
    assert r.exit_code == 2 and "--shape" in r.output


def test_transformers_assisted_generation_takes_the_reduced_vocabulary_draft(chat_draft, chat_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leaplm.bench.runner import hf_assistant

    tok = AutoTokenizer.from_pretrained(chat_target)
    model = AutoModelForCausalLM.from_pretrained(chat_target).eval()
    ids = tok("hello, how are you", return_tensors="pt")
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        plain = model.generate(**ids, **kw)
        assisted = model.generate(**ids, **kw, assistant_model=hf_assistant(chat_draft, torch.float32),
                                  num_assistant_tokens=3)
    assert assisted.tolist() == plain.tolist()


def test_chat_workloads_go_through_the_template(chat_target):
    from transformers import AutoTokenizer

    from leaplm.bench.workloads import CHAT_WORKLOADS, as_chat, get_workload

    tok = AutoTokenizer.from_pretrained(chat_target)
    for name in CHAT_WORKLOADS:
        w = get_workload(name, 3)
        assert w.chat and len(w.prompts) == 3
        c = as_chat(w, tok)
        assert not c.chat and all(p.startswith("<|user|>") and p.endswith("<|assistant|>") for p in c.prompts)
    assert all(p.startswith("Write a Python function `") for p in get_workload("chat-code", 3).prompts)


def test_text_only_prior_before_any_answer(chat_target, tmp_path):
    empty = tmp_path / "none"
    empty.mkdir()
    cfg = ChatDistillConfig(model=chat_target, logits_dir=str(empty), out_dir=str(tmp_path / "m"), shape="tiny",
                            draft_vocab=40, steps=2, batch_size=2, warmup_steps=1, save_every=2,
                            text_weight=1.0, text_max_files=2, text_seq_len=32)
    last = distill_chat(cfg)
    assert last.step == 2 and last.loss > 0 and last.eval_kl is None
    assert len(read_d2t(tmp_path / "m")) == 40
    with pytest.raises(FileNotFoundError, match="logits_dir"):
        distill_chat(ChatDistillConfig(model=chat_target, logits_dir=str(empty), out_dir=str(tmp_path / "m2"),
                                       shape="tiny", steps=1))

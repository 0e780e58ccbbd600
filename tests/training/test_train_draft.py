"""`train draft`: data + distillation in one resumable run directory, on a tiny random target; the draft it
makes is lossless behind its target; a cut draft starts from the target's own layers; the tv loss is the
sampled acceptance it reports; bad run directories and targets are refused by name."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.training.chat_distill import ChatBatch, chat_loss
from leaplm.training.chat_draft_init import cut_layers
from leaplm.training.draft_run import DraftRunConfig, train_draft

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory, checkpoint):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("draft_target")
    shutil.copytree(checkpoint("llama_tied"), d, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    return str(d)


def run_config(target, out, **kw) -> DraftRunConfig:
    base = dict(target=target, out_dir=str(out), shape="cut-1", draft_vocab=40, n_prompts=6, new_tokens=8,
                top_k=4, max_prompt_tokens=200, batch_size_data=3, shard_rows=3, steps=4, batch_size=2,
                warmup_steps=1, save_every=2, eval_every=2, max_files=20, threads=1)
    return DraftRunConfig(**(base | kw))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, chat_target):
    out = tmp_path_factory.mktemp("run")
    seen = []
    last = train_draft(run_config(chat_target, out), seen.append)
    assert last.step == 4
    assert {p.stage for p in seen} == {"data", "distill"}
    return out


def test_one_run_makes_data_and_a_lossless_draft(run_dir, chat_target):
    assert len(list((run_dir / "chatdata").glob("chat-*.safetensors"))) == 2
    engine = Engine(chat_target, draft=str(run_dir / "draft"), method="draft", k=3, adaptive_k=False)
    plain = Engine(chat_target, method="none")
    ids = plain.encode("hello, how are you", SamplingParams())
    greedy = SamplingParams(max_new_tokens=20, temperature=0)
    out = engine.generate(ids, greedy)
    assert out.token_ids == plain.generate(ids, greedy).token_ids and out.stats.draft_tokens > 0


def test_cut_draft_starts_as_the_targets_first_layers(run_dir, chat_target):
    from safetensors.torch import load_file

    cfg = json.loads((run_dir / "draft" / "config.json").read_text())
    tcfg = json.loads((__import__("pathlib").Path(chat_target) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == tcfg["hidden_size"]
    assert cfg["num_hidden_layers"] < tcfg["num_hidden_layers"]
    # a 0-step run keeps the copied weights: layer 0 equals the target's (up to the fp16 of the saved draft)
    # (checked on a fresh build, the trained one has moved)
    from leaplm.models.draft_vocab import read_d2t
    from leaplm.training.chat_draft_init import build_cut_draft

    d2t = read_d2t(run_dir / "draft")
    draft = build_cut_draft(chat_target, 1, d2t, eos_target=0)
    tsd = load_file(str(__import__("pathlib").Path(chat_target) / "model.safetensors"))
    w = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(draft.state_dict()[w], tsd[w].float())
    assert draft.model.embed_tokens.weight.data_ptr() == draft.lm_head.weight.data_ptr()
    torch.testing.assert_close(draft.model.embed_tokens.weight[1:], tsd["model.embed_tokens.weight"][d2t[1:]].float())
    with pytest.raises(ConfigError, match="only"):
        build_cut_draft(chat_target, tcfg["num_hidden_layers"], d2t, eos_target=0)
    assert cut_layers("cut-3") == 3 and cut_layers("cut-0") is None and cut_layers("chat-1x256") is None


def test_cut_from_a_gguf_file_equals_the_cut_from_its_checkpoint(run_dir, chat_target, tmp_path):
    from leaplm.models.draft_vocab import read_d2t
    from leaplm.models.gguf_export import export_gguf
    from leaplm.training.chat_draft_init import build_cut_draft

    gguf = export_gguf(chat_target, str(tmp_path / "t.gguf"), "f32").path      # q, k rows permuted as llama.cpp's
    d2t = read_d2t(run_dir / "draft")
    a = build_cut_draft(chat_target, 1, d2t, eos_target=0).state_dict()
    b = build_cut_draft(str(gguf), 1, d2t, eos_target=0).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)


def test_rerun_resumes_and_longer_budget_continues(run_dir, chat_target):
    before = {p.name: p.stat().st_mtime_ns for p in (run_dir / "chatdata").glob("chat-*")}
    assert train_draft(run_config(chat_target, run_dir)) is None                  # finished: nothing to do
    last = train_draft(run_config(chat_target, run_dir, steps=6))
    assert last.step == 6
    assert {p.name: p.stat().st_mtime_ns for p in (run_dir / "chatdata").glob("chat-*")} == before
    steps = [json.loads(x)["step"] for x in (run_dir / "draft" / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]                                           # resumed at 4, not restarted


def test_sampled_stage_continues_the_draft_on_total_variation(chat_target, tmp_path):
    cfg = run_config(chat_target, tmp_path, sampled_steps=2, sampled_temperatures=(0.8,))
    last = train_draft(cfg)
    assert last.step == 6
    steps = [json.loads(x)["step"] for x in (tmp_path / "draft" / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]                                           # 4 of kl, then 2 more of tv
    trained = json.loads((tmp_path / "draft" / "train_config.json").read_text())
    assert (trained["loss"], trained["temperatures"], trained["steps"]) == ("tv", [0.8], 6)
    assert train_draft(cfg) is None                                              # both stages done
    with pytest.raises(ConfigError, match="sampled_temperatures") as e:
        train_draft(run_config(chat_target, tmp_path, sampled_steps=2, sampled_temperatures=(1.0,)))
    assert e.value.field == "out_dir"


def test_a_run_json_without_a_newer_setting_resumes_at_its_default(run_dir, chat_target):
    path = run_dir / "run.json"
    run = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in run.items() if k != "sampled_temperatures"}))
    try:
        assert train_draft(run_config(chat_target, run_dir, steps=6)) is None     # accepted, nothing to do
    finally:
        path.write_text(json.dumps(run))


@pytest.mark.parametrize("field,value", [("sampled_steps", -1), ("sampled_temperatures", (float("nan"),)),
                                         ("sampled_temperatures", ()), ("sampled_temperatures", (1e300,))])
def test_bad_sampled_stage_settings_are_named(chat_target, tmp_path, field, value):
    with pytest.raises(ConfigError) as e:
        train_draft(run_config(chat_target, tmp_path / "o", **{field: value}))
    assert e.value.field == field
    assert not (tmp_path / "o").exists()


def test_interrupted_run_resumes_from_its_checkpoint(chat_target, tmp_path):
    class Stop(Exception):
        pass

    def stop_at_3(p):
        if p.stage == "distill" and p.done == 3:
            raise Stop

    with pytest.raises(Stop):
        train_draft(run_config(chat_target, tmp_path), stop_at_3)
    last = train_draft(run_config(chat_target, tmp_path))
    steps = [json.loads(x)["step"] for x in (tmp_path / "draft" / "train_log.jsonl").read_text().splitlines()]
    assert last.step == 4 and steps[-2:] == [3, 4] and steps.count(3) == 2        # checkpoint at 2: 3 is redone


def test_output_directory_of_another_run_is_refused(run_dir, chat_target, tmp_path):
    with pytest.raises(ConfigError, match="draft_vocab") as e:
        train_draft(run_config(chat_target, run_dir, draft_vocab=50))
    assert e.value.field == "out_dir"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="run.json") as e:
        train_draft(run_config(chat_target, other))
    assert e.value.field == "out_dir"
    run = json.loads((run_dir / "run.json").read_text())
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "run.json").write_text(json.dumps(run | {"tokenizer_sha256": "0" * 64, "target": "x.gguf"}))
    with pytest.raises(ConfigError, match="another target") as e:
        train_draft(run_config(chat_target, foreign))


def test_targets_it_cannot_run_are_refused(tmp_path, chat_target):
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ConfigError, match="not a GGUF file") as e:
        train_draft(run_config(str(bad), tmp_path / "o"))
    assert e.value.field == "target"
    with pytest.raises(ConfigError) as e:
        train_draft(run_config(str(tmp_path / "missing"), tmp_path / "o"))
    assert e.value.field == "target"
    with pytest.raises(ConfigError) as e:
        train_draft(run_config(chat_target, tmp_path / "o", shape="wide"))
    assert e.value.field == "shape"
    assert not (tmp_path / "o").exists()                                          # refused before writing


def test_tv_loss_is_one_minus_the_sampled_overlap():
    # one position, draft vocabulary of 4 rows (row 0 = other); the target's top 2 are rows 1 and 2
    b = ChatBatch(inputs=torch.zeros(1, 1, dtype=torch.long), where=torch.zeros(1, 2, dtype=torch.long),
                  topk=torch.tensor([[1, 2]]), topk_in=torch.tensor([[True, True]]),
                  topk_logp=torch.log(torch.tensor([[0.7, 0.3]])), emitted=torch.tensor([1]),
                  argmax_in=torch.tensor([True]))
    logits = torch.log(torch.tensor([[1e-9, 0.5, 0.25, 0.25]]))
    r = chat_loss(logits, b, alpha=1.0, temperatures=(1.0,), loss="tv")
    # q = (0.5, 0.25, 0.25) over rows 1..3; sum min(p, q) = min(.7,.5) + min(.3,.25) = 0.75
    torch.testing.assert_close(r.overlap, torch.tensor(0.75), atol=1e-5, rtol=0)
    torch.testing.assert_close(r.loss, torch.tensor(0.25), atol=1e-5, rtol=0)
    kl = chat_loss(logits, b, alpha=1.0, temperatures=(1.0,), loss="kl")
    assert not torch.allclose(kl.loss, r.loss)


def test_libllama_chat_data_equals_the_engines_greedy_answers(chat_target, tmp_path):
    pytest.importorskip("llama_cpp")                      # the optional llama.cpp extra
    from safetensors.torch import load_file

    from leaplm.models.gguf_export import export_gguf
    from leaplm.training.chat_ondata import ChatDataConfig, generate_chat_logits

    gguf = export_gguf(chat_target, str(tmp_path / "t.gguf"), "f32").path
    cfg = dict(n_prompts=3, new_tokens=8, top_k=4, batch_size=2, shard_rows=3, temperatures=(0.0,),
               max_prompt_tokens=200, max_files=20)
    generate_chat_logits(ChatDataConfig(model=str(gguf), out_dir=str(tmp_path / "l"), backend="llamacpp", **cfg))
    generate_chat_logits(ChatDataConfig(model=str(gguf), out_dir=str(tmp_path / "e"), backend="engine", **cfg))
    a = load_file(str(tmp_path / "l" / "chat-00000.safetensors"))
    b = load_file(str(tmp_path / "e" / "chat-00000.safetensors"))
    assert a["prompt_len"].tolist() == b["prompt_len"].tolist()
    compared = 0
    for r in range(3):
        P = int(a["prompt_len"][r])
        assert a["input_ids"][r, :P].tolist() == b["input_ids"][r, :P].tolist()
        for t in range(min(int(a["answer_len"][r]), int(b["answer_len"][r]))):
            # f32 weights, but libllama keeps its KV cache in f16 and reduces in another order: log-probs agree
            # to ~1e-2 (and are stored in fp16), so greedy answers may part only where the top two are that close
            la, lb = a["topk_logp"][r, t].float(), b["topk_logp"][r, t].float()
            torch.testing.assert_close(la, lb, atol=2e-2, rtol=0)
            ta, tb = int(a["input_ids"][r, P + t]), int(b["input_ids"][r, P + t])
            compared += 1
            if ta != tb:
                assert abs(float(lb[0] - lb[1])) < 2e-2, (r, t, la, lb)
                break
        else:
            assert int(a["answer_len"][r]) == int(b["answer_len"][r])      # same EOS, or both at new_tokens
    assert compared >= 12
    with pytest.raises(ConfigError, match="GGUF") as e:
        ChatDataConfig(model=chat_target, out_dir=str(tmp_path / "x"), backend="llamacpp").resolved_backend()
    assert e.value.field == "backend"


def test_cli_train_draft_runs_resumes_and_names_bad_options(chat_target, tmp_path):
    from typer.testing import CliRunner

    from leaplm.cli import app

    args = ["train", "draft", "--target", chat_target, "--out", str(tmp_path / "r"), "--shape", "tiny",
            "--draft-vocab", "32", "--n-prompts", "4", "--new-tokens", "6", "--steps", "2", "--batch-size", "2",
            "--max-prompt-tokens", "200", "--max-files", "20", "--threads", "1"]
    run = CliRunner()
    r = run.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "r" / "draft" / "draft_vocab.safetensors").is_file()
    r = run.invoke(app, args)
    assert r.exit_code == 0 and "nothing to do" in r.output
    r = run.invoke(app, [*args[:-2], "--draft-vocab", "40"])
    assert r.exit_code == 2 and "--out" in r.output and "draft_vocab" in r.output
    r = run.invoke(app, [*args[:5], str(tmp_path / "r2"), *args[6:], "--loss", "js"])
    assert r.exit_code == 2 and "--loss" in r.output
    r = run.invoke(app, [*args[:5], str(tmp_path / "r3"), *args[6:], "--data-temperatures", "0,x"])
    assert r.exit_code == 2 and "--data-temperatures" in r.output
    r = run.invoke(app, [*args[:5], str(tmp_path / "r5"), *args[6:], "--sampled-temperatures", "0"])
    assert r.exit_code == 2 and "--sampled-temperatures" in r.output
    r = run.invoke(app, ["train", "draft", "--target", str(tmp_path / "nothing.gguf"), "--out", str(tmp_path / "r4")])
    assert r.exit_code == 2 and "--target" in r.output


@pytest.mark.parametrize("loss", ["kl", "tv"])
def test_positions_without_any_top_k_in_the_vocabulary_give_finite_gradients(loss):
    # position 1's top 2 both lie outside the draft vocabulary (draft id 0): it must not poison the gradient
    b = ChatBatch(inputs=torch.zeros(1, 2, dtype=torch.long), where=torch.tensor([[0, 0], [0, 1]]),
                  topk=torch.tensor([[1, 2], [0, 0]]), topk_in=torch.tensor([[True, True], [False, False]]),
                  topk_logp=torch.log(torch.tensor([[0.7, 0.3], [0.6, 0.4]])), emitted=torch.tensor([1, 0]),
                  argmax_in=torch.tensor([True, False]))
    logits = torch.randn(2, 4, requires_grad=True)
    r = chat_loss(logits, b, alpha=0.9, temperatures=(1.0, 0.8), loss=loss)
    r.loss.backward()
    assert torch.isfinite(r.loss) and torch.isfinite(logits.grad).all()

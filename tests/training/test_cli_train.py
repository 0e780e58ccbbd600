import json

import pytest
from typer.testing import CliRunner

from leaplm.cli.evaluate import eval_app
from leaplm.cli.train import train_app

runner = CliRunner()
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def run(app, *args):
    return runner.invoke(app, [str(a) for a in args], env=ENV)


@pytest.mark.parametrize("args,option", [
    (["pretrain", "--out", "x", "--tokenizer", "/nonexistent"], "--tokenizer"),
    (["distill", "--target", "/nonexistent", "--out", "x"], "--target"),
    (["tokenizer", "--out", "x", "--corpus", "/no/such/corpus"], "--corpus"),
    (["tokenizer", "--out", "x", "--vocab-size", "10"], "--vocab-size"),
])
def test_bad_input_names_the_option(args, option):
    r = run(train_app, *args)
    assert r.exit_code == 2, r.output
    assert option in r.output and "Traceback" not in r.output


def test_bad_numbers_and_presets(tmp_path, tiny_tokenizer_dir, tiny_target_dir):
    r = run(train_app, "pretrain", "--out", tmp_path / "o", "--tokenizer", tiny_tokenizer_dir, "--tokens", 0)
    assert r.exit_code == 2 and "--tokens" in r.output
    r = run(train_app, "pretrain", "--out", tmp_path / "o", "--tokenizer", tiny_tokenizer_dir, "--preset", "huge")
    assert r.exit_code == 2 and "--preset" in r.output and "draft-3m" in r.output
    r = run(train_app, "distill", "--target", tiny_target_dir, "--out", tmp_path / "o", "--alpha", 2)
    assert r.exit_code == 2 and "--alpha" in r.output
    r = run(train_app, "distill", "--target", tiny_target_dir, "--out", tmp_path / "o", "--draft-init", "nope")
    assert r.exit_code == 2 and "--draft-init" in r.output


def test_library_config_error_becomes_usage_error(tmp_path, tiny_target_dir, tiny_draft_dir):
    # caught inside DistillConfig.validate, reported against the option
    r = run(train_app, "distill", "--target", tiny_target_dir, "--out", tiny_draft_dir, "--draft-init", tiny_draft_dir)
    assert r.exit_code == 2 and "--out" in r.output and "draft_init" in r.output
    assert "Traceback" not in r.output


def test_cli_tokenizer_pretrain_distill_card_perplexity(tmp_path):
    tok, target, draft = tmp_path / "tok", tmp_path / "target", tmp_path / "draft"
    small = ["--batch-size", 2, "--seq-len", 32, "--long-fraction", 0, "--warmup-steps", 1, "--eval-batches", 1,
             "--max-files", 5, "--threads", 1]
    r = run(train_app, "tokenizer", "--out", tok, "--vocab-size", 300, "--max-files", 5)
    assert r.exit_code == 0, r.output
    r = run(train_app, "pretrain", "--out", target, "--tokenizer", tok, "--preset", "tiny", "--tokens", 128, *small)
    assert r.exit_code == 0, r.output
    assert "done: step 2/2" in r.output and (target / "model.safetensors").exists()
    r = run(train_app, "distill", "--target", target, "--out", draft, "--draft-init", "tiny", "--tokens", 128,
            "--alpha", 0.5, *small)
    assert r.exit_code == 0, r.output
    assert "done: step 2/2" in r.output
    r = run(train_app, "distill", "--target", target, "--out", draft, "--draft-init", "tiny", "--tokens", 128, *small)
    assert r.exit_code == 0 and "nothing to do" in r.output

    rows = tmp_path / "acc.json"
    rows.write_text(json.dumps([{"method": "draft_model", "K": 4, "acceptance rate": 0.5}]))
    r = run(train_app, "card", "--model", draft, "--acceptance", rows, "--ppl-tokens", 64, "--threads", 1)
    assert r.exit_code == 0, r.output
    text = (draft / "README.md").read_text()
    assert "| draft_model | 4 | 0.5 |" in text and "perplexity on stdlib/heldout" in text

    r = run(eval_app, "perplexity", "--model", target, "--seq-len", 32, "--max-tokens", 64, "--max-files", 5,
            "--json", "--threads", 1)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert out["tokens"] == 62 and out["perplexity"] > 1


def test_card_rejects_bad_acceptance_json(tmp_path, tiny_target_dir):
    bad = tmp_path / "acc.json"
    bad.write_text("{not json")
    r = run(train_app, "card", "--model", tiny_target_dir, "--acceptance", bad, "--no-perplexity")
    assert r.exit_code == 2 and "--acceptance" in r.output

"""Prompt tokenization as the ecosystem does it: BOS per the tokenizer's configuration (here a GGUF file's
tokenizer.ggml.add_bos_token), never twice; --chat applies the model's chat template; no template, clear error."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gguf_writer import write_tiny_gguf
from leaplm.cli import app
from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import load_model
from leaplm.models.tokens import chat_prompt, encode_prompt

TEXT = "the quick brown fox"


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """(file that asks for BOS, file that does not): same weights and tokenizer otherwise."""
    yes, _ = write_tiny_gguf(tmp_path_factory.mktemp("bos_yes"), "F32", add_bos=True)
    no, _ = write_tiny_gguf(tmp_path_factory.mktemp("bos_no"), "F32", add_bos=False)
    return load_model(yes), load_model(no)


def test_bos_follows_the_files_add_bos_token(gguf_pair):
    yes, no = gguf_pair
    plain = no.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    bos = yes.tokenizer.bos_token_id
    assert yes.bos_id == bos is not None and no.bos_id is None
    e_yes, e_no = Engine(model=yes, method="none"), Engine(model=no, method="none")
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    assert e_yes.encode(TEXT, sp) == [bos] + plain
    assert e_no.encode(TEXT, sp) == plain
    # never twice: a prompt (or a chat template) that already starts with BOS keeps one
    assert e_yes.encode(yes.tokenizer.bos_token + TEXT, sp) == [bos] + plain
    assert encode_prompt(yes.tokenizer, TEXT, None) == plain


def test_chat_template_from_the_file_and_refusal_without_one(gguf_pair, checkpoint):
    yes, _ = gguf_pair
    assert chat_prompt(yes.tokenizer, "hi") == "<|user|>hi<eos><|assistant|>"
    no_template = load_model(checkpoint("llama_tied"))
    with pytest.raises(ConfigError, match="no chat template") as e:
        chat_prompt(no_template.tokenizer, "hi", "tiny")
    assert e.value.field == "chat"


def test_cli_chat_generates_from_the_template(gguf_pair, checkpoint):
    yes, _ = gguf_pair
    runner = CliRunner()
    res = runner.invoke(app, ["generate", "hi", "--model", yes.path, "--chat", "--max-new-tokens", "6",
                              "--ignore-eos", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["samples"][0]["token_ids"]
    eng = Engine(model=yes, method="none")
    ref = eng.generate("<|user|>hi<eos><|assistant|>", SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                       ignore_eos=True)).token_ids
    assert got == ref
    res = runner.invoke(app, ["generate", "hi", "--model", checkpoint("llama_tied"), "--chat"])
    assert res.exit_code == 2 and "--chat" in res.output and "chat template" in res.output

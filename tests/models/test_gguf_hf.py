"""The Hugging Face config and tokenizer made from parse_gguf's metadata equal what transformers' own GGUF entry
points make of the same file (load_gguf_checkpoint's config, AutoTokenizer's tokenizer), on every architecture
leaplm runs, and a first load builds them without the `gguf` package's reader."""
from __future__ import annotations

import pytest

from gguf_writer import write_tiny_gguf
from leaplm.models import gguf as gguf_mod
from leaplm.models.gguf import inspect_gguf, parse_gguf
from leaplm.models.gguf_hf import convert_tokenizer, hf_config_dict, tokenizer_class

TEXTS = ["the quick brown fox", "def add(a, b):\n    return a + b", "<eos> after", "ünïcödé ✓"]
CASES = {"llama": dict(arch="llama"), "llama-tied": dict(arch="llama", tied=True), "qwen2": dict(arch="qwen2"),
         "qwen3": dict(arch="qwen3"), "mistral": dict(arch="llama", name="mistral")}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}

    def make(case: str) -> str:
        if case not in out:
            out[case] = write_tiny_gguf(tmp_path_factory.mktemp(case), "Q8_0", **CASES[case])[0]
        return out[case]
    return make


def meta(path) -> tuple[dict, dict]:
    g = parse_gguf(path)
    return g.fields, g.tensors


def saved(tok, d) -> dict[str, bytes]:
    tok.save_pretrained(str(d))
    return {p.name: p.read_bytes() for p in d.iterdir()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_equals_transformers_gguf_loader_s(files, case):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = files(case)
    want = load_gguf_checkpoint(path, return_tensors=False)["config"]
    have = hf_config_dict(*meta(path))
    assert have == want
    assert have["model_type"] == ("mistral" if case == "mistral" else CASES[case]["arch"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_tokenizer_equals_autotokenizer_s(files, case, tmp_path):
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(files(case))
    want = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    have = convert_tokenizer(path, hf_config_dict(*meta(path)))
    assert type(have) is type(want)
    assert saved(have, tmp_path / "have") == saved(want, tmp_path / "want")
    for t in TEXTS:
        assert have(t)["input_ids"] == want(t)["input_ids"], t


def test_a_tokenizer_config_beside_the_file_leaves_the_choice_to_autotokenizer(files, tmp_path):
    import shutil
    from pathlib import Path

    from transformers import AutoTokenizer

    src = Path(files("llama"))
    cfg = hf_config_dict(*meta(src))
    assert tokenizer_class(src, cfg) is not None
    path = tmp_path / src.name
    shutil.copy(src, path)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    assert tokenizer_class(path, cfg) is None
    have = convert_tokenizer(path, cfg)
    want = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert type(have) is type(want)


def test_a_first_load_does_not_read_the_file_through_the_gguf_package(files, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)
    gguf_mod._tokenizers.clear()
    info = inspect_gguf(files("qwen2"))
    reads = []
    real = gguf.GGUFReader

    def counted(*a, **kw):
        reads.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    cfg, tok = gguf_mod.read_gguf_config(info), gguf_mod.load_gguf_tokenizer(info)
    assert reads == []
    assert cfg["model_type"] == "qwen2" and tok("the quick brown fox")["input_ids"]
    # the control: transformers' own loader does read it so
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    load_gguf_checkpoint(str(info.path), return_tensors=False)
    assert len(reads) == 1

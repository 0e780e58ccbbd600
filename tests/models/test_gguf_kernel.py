"""GGUF files straight into the int8 kernel: the header parser agrees with the `gguf` package's reader, loading
makes no full-precision copy of any weight, the logits equal those of the dequantize-then-pack path bit for bit,
and the tokenizer and config come back from the start-up cache unchanged."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_writer import write_tiny_gguf
from leaplm.config import ConfigError
from leaplm.models import gguf as gguf_mod
from leaplm.models import load_model
from leaplm.models.gguf import inspect_gguf, parse_gguf

TEXTS = ["the quick brown fox", "def add(a, b):\n    return a + b", "  spaces  and\ttabs", "<eos> after", "ünïcödé ✓"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)
    gguf_mod._tokenizers.clear()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}

    def make(qtype: str, tied: bool = False) -> str:
        if (qtype, tied) not in out:
            out[(qtype, tied)] = write_tiny_gguf(tmp_path_factory.mktemp(f"k_{qtype}"), qtype, tied=tied)[0]
        return out[(qtype, tied)]
    return make


def test_header_parser_agrees_with_the_gguf_reader(files):
    from gguf import GGUFReader

    path = files("Q4_1")
    g, r = parse_gguf(path), GGUFReader(path)
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        want, have = f.contents(), g.fields[key]
        have = have.tolist() if isinstance(have, np.ndarray) else have
        assert have == (pytest.approx(want) if isinstance(want, float) else want), key
    assert list(g.tensors) == [t.name for t in r.tensors]
    for t in r.tensors:
        assert g.tensors[t.name].type_name == t.tensor_type.name
        assert np.array_equal(g.raw(t.name).reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("qtype,tied", [("Q8_0", False), ("Q4_0", True), ("Q4_1", False), ("Q4_K_M", False),
                                        ("Q4_K_M", True)])
def test_kernel_load_makes_no_full_precision_copy_and_equals_the_dequantizing_path(files, qtype, tied, monkeypatch):
    import transformers.modeling_gguf_pytorch_utils as tgguf

    from leaplm.quant.apply import quantize_model

    path = files(qtype, tied)
    ref = load_model(path, backend="torch")                    # dequantized by transformers, then packed
    quantize_model(ref.model, "gguf", gguf_path=path)
    before = gguf_mod.DEQUANTIZED_BYTES[0]
    real = tgguf.load_gguf_checkpoint

    def no_tensors(*a, **kw):
        assert not kw.get("return_tensors"), "the kernel path read the file's tensors through transformers"
        return real(*a, **kw)

    monkeypatch.setattr(tgguf, "load_gguf_checkpoint", no_tensors)
    lm = load_model(path, quantization="gguf")
    assert gguf_mod.DEQUANTIZED_BYTES[0] == before
    m = lm.model
    hid = m.args.hidden_size
    # no parameter holds a matrix: the embedding and every linear weight live in the file's blocks
    assert all(p.numel() <= 3 * hid for p in m.parameters()), [(n, p.shape) for n, p in m.named_parameters()
                                                                 if p.numel() > 3 * hid]
    assert m.embed_quantized is not None
    ids = torch.tensor([lm.tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]])
    assert torch.equal(m(ids, m.new_cache(1, 64)), ref.model(ids, ref.model.new_cache(1, 64)))
    assert torch.equal(m.embed_weight(), ref.model.embed_tokens.weight.detach())
    assert lm.tokenizer.chat_template == ref.tokenizer.chat_template


@pytest.mark.parametrize("qtype,tied", [("Q4_0", True), ("Q4_K_M", False)])
def test_a_kernel_model_holds_one_copy_of_each_weight(files, qtype, tied):
    """The linears hold the kernel's layout alone (no block-format copy beside it); the embedding is read from the
    memory map (no converted copy), so a tied head's tensor is held once, in the kernel's layout."""
    from leaplm.kernels.build import unavailable_reason
    from leaplm.models.gguf_kernel import FileRows

    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    m = load_model(files(qtype, tied), quantization="gguf").model
    parts = [p for lin in m.quantized.values() for p in lin.parts]
    assert parts and all(p.packed is not None and p._weight is None for p in parts)
    e = m.embed_quantized
    assert isinstance(e, FileRows) and not e.raw.flags.owndata           # a view of the mapping
    ids = torch.tensor([3, 1, 3])
    rows = e.rows(ids)
    assert rows.q.shape[0] == 3 and torch.equal(rows.q[0], rows.q[2])
    # the rows a step converts are the embedding's rows
    from leaplm.quant.formats import dequantize

    torch.testing.assert_close(dequantize(rows), m.embed_weight()[ids], rtol=0, atol=0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K_M"])
def test_a_second_load_maps_the_packed_linears_from_the_cache(files, qtype, monkeypatch):
    """The first load packs the file's blocks and keeps the layout (models/packed_cache.py); the second packs nothing
    and computes the same bits. Control: --recalibrate packs again."""
    from leaplm.kernels.build import unavailable_reason
    from leaplm.quant import linear as linear_mod

    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    path = files(qtype)
    ids = torch.tensor([[5, 9, 2, 7, 7, 1]])
    first = load_model(path, quantization="gguf").model
    want = first(ids, first.new_cache(1, 16))
    packs = []
    for name in ("pack_gguf", "pack"):
        real = getattr(linear_mod, name)
        monkeypatch.setattr(linear_mod, name, lambda *a, _real=real, **kw: packs.append(1) or _real(*a, **kw))
    second = load_model(path, quantization="gguf").model
    assert packs == []
    assert torch.equal(second(ids, second.new_cache(1, 16)), want)
    monkeypatch.setenv("LEAPLM_RECALIBRATE", "1")
    load_model(path, quantization="gguf")
    assert packs


def test_a_new_packed_entry_of_a_file_removes_its_old_one(files, monkeypatch):
    """A changed packing code (another key) packs the file again and removes the entry it replaces; another file's
    entry stays. Control: the old entry existed and was this file's."""
    from leaplm.kernels.build import unavailable_reason
    from leaplm.models import packed_cache

    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    path, other = files("Q4_0"), files("Q8_0")
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)     # writing a tiny file sets it (tests' default)
    load_model(path, quantization="gguf")
    load_model(other, quantization="gguf")
    old = packed_cache.entry_dir_of(path)
    kept = packed_cache.entry_dir_of(other)
    assert (old / packed_cache.FILE).exists() and (kept / packed_cache.FILE).exists()
    real = packed_cache._key
    import os

    monkeypatch.setattr(packed_cache, "_key", lambda p: real(p) + "-next" if os.path.samefile(p, path) else real(p))
    load_model(path, quantization="gguf")
    assert (packed_cache.entry_dir_of(path) / packed_cache.FILE).exists()
    assert not old.exists() and (kept / packed_cache.FILE).exists()


def test_tokenizer_and_config_come_back_from_the_cache_unchanged(files, tmp_path):
    path = files("Q8_0")
    info = inspect_gguf(path)
    first_tok, first_cfg = gguf_mod.load_gguf_tokenizer(info), gguf_mod.read_gguf_config(info)
    gguf_mod._tokenizers.clear()
    k = gguf_mod.cache_key(info)
    from leaplm import startup_cache

    assert (startup_cache.entry_dir("gguf-tokenizer", k) / "done").exists()
    again_tok, again_cfg = gguf_mod.load_gguf_tokenizer(info), gguf_mod.read_gguf_config(info)
    assert again_tok is not first_tok and again_cfg == first_cfg
    assert type(again_tok).__name__ == "CachedTokenizer"          # read without transformers
    for t in TEXTS:
        for special in (True, False):
            assert again_tok(t, add_special_tokens=special)["input_ids"] == \
                first_tok(t, add_special_tokens=special)["input_ids"], (t, special)
    assert again_tok.chat_template == first_tok.chat_template
    assert (again_tok.bos_token_id, again_tok.eos_token_id) == (first_tok.bos_token_id, first_tok.eos_token_id)
    ids = first_tok(TEXTS[4])["input_ids"]
    assert again_tok.decode(ids) == first_tok.decode(ids)
    chat = [{"role": "user", "content": "hi"}]
    assert again_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        first_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert again_tok.get_vocab() == first_tok.get_vocab() and len(again_tok) == len(first_tok)


def test_a_changed_file_gets_a_new_cache_key(files, tmp_path):
    import os
    import shutil

    src = files("Q8_0")
    path = tmp_path / "copy.gguf"
    shutil.copy(src, path)
    k0 = gguf_mod.cache_key(inspect_gguf(str(path)))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    k1 = gguf_mod.cache_key(inspect_gguf(str(path)))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF                                       # same size and a new content
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    k2 = gguf_mod.cache_key(inspect_gguf(str(path)))
    assert len({k0, k1, k2}) == 3


def test_tensor_running_past_the_end_is_refused_naming_the_file(files, tmp_path):
    data = open(files("Q8_0"), "rb").read()
    t = tmp_path / "short.gguf"
    t.write_bytes(data[:-100])
    with pytest.raises(ConfigError, match="short.gguf.*truncated"):
        parse_gguf(t)


def test_shipped_tokenizers_read_without_transformers_encode_as_transformers_does():
    from transformers import AutoTokenizer

    from leaplm.models.embedded import available
    from leaplm.models.loading import load_tokenizer

    dirs = {n: p for n, p in available().items() if (p / "tokenizer.json").exists()}
    assert "target" in dirs
    for name, path in dirs.items():
        fast, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
        assert type(fast).__name__ == "CachedTokenizer", name
        for t in TEXTS:
            for special in (True, False):
                assert fast(t, add_special_tokens=special)["input_ids"] == \
                    ref(t, add_special_tokens=special)["input_ids"], (name, t, special)
        assert (fast.bos_token_id, fast.eos_token_id, fast.chat_template) == \
            (ref.bos_token_id, ref.eos_token_id, ref.chat_template), name


def test_the_ggml_type_table_is_the_gguf_package_s():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for type_id, (name, block, size) in gguf_mod.GGML_TYPES.items():
        qt = GGMLQuantizationType(type_id)
        assert (qt.name, *GGML_QUANT_SIZES[qt]) == (name, block, size)
    assert gguf_mod.ggml_type(20, "t") == ("IQ4_NL", 32, 18)          # not in the table: the package answers
    with pytest.raises(ValueError, match="'t' has unknown type id 9999"):
        gguf_mod.ggml_type(9999, "t")

"""Synthetic GGUF files (models/synth.py): tiny shapes of each architecture in each format written, read back by
leaplm's parser with the planned types and shapes, their weights' statistics as designed, loaded and decoded by
libllama and by leaplm with finite logits; memory bounded by a chunk while writing; the shape table checked against
the published parameter counts; the refusal of synthetic files outside benchmarks."""
from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch

from gguf_writer import write_tiny_gguf
from leaplm.config import ConfigError, SamplingParams
from leaplm.models.gguf import parse_gguf
from leaplm.models.llamacpp.binding import available
from leaplm.models.synth import (BLOCK_TYPES, DEFAULT_STD, matrix_type, plan_tensors, random_blocks,
                                 refuse_synthetic, use_more_bits, write_synthetic_gguf)
from leaplm.models.synth_shapes import SHAPES, SynthShape, shape_named

needs_libllama = pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")
FORMATS = ("Q4_0", "Q8_0", "Q4_K_M")


def tiny(arch: str, tied: bool = True, hidden: int = 256, vocab: int = 400) -> SynthShape:
    """A test-only shape: rows of 256 (every K-quant applies) unless `hidden` says otherwise."""
    return SynthShape(f"tiny-{arch}", arch, hidden, 2, 4, 2, 64, 512, vocab, tied, 10000.0, 1e-5, 512, "test",
                      sliding_window=64 if arch == "gemma3" else 0)


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory):
    """A GGUF file with a byte-level BPE tokenizer (tests/models/gguf_writer.py) to borrow from."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tok"), "Q8_0")[0]


_written: dict[tuple, object] = {}


@pytest.fixture(scope="module")
def synth_file(tmp_path_factory, tokenizer_gguf):
    def make(arch: str, fmt: str, tied: bool = True):
        key = (arch, fmt, tied)
        if key not in _written:
            d = tmp_path_factory.mktemp(f"synth_{arch}_{fmt}")
            _written[key] = write_synthetic_gguf(tiny(arch, tied), fmt, d / "m.gguf", tokenizer_gguf)
        return _written[key]
    return make


CASES = [("llama", f, True) for f in FORMATS] + [("qwen2", "Q4_K_M", False), ("gemma3", "Q4_0", True),
                                                 ("gemma3", "Q4_K_M", True)]


@pytest.mark.parametrize("arch,fmt,tied", CASES)
def test_the_file_reads_back_with_the_planned_types_and_shapes(synth_file, arch, fmt, tied):
    r = synth_file(arch, fmt, tied)
    g = parse_gguf(r.path)
    plan = plan_tensors(tiny(arch, tied), fmt, r.vocab)
    assert list(g.tensors) == [t.name for t in plan]
    for t in plan:
        assert (g.tensors[t.name].type_name, g.tensors[t.name].shape) == (t.type_name, t.shape), t.name
    assert ("output.weight" in g.tensors) == (not tied)
    assert g.fields["general.architecture"] == arch
    assert g.fields["leaplm.synthetic"] is True
    assert "random weights, shape of tiny-" in g.fields["general.description"]
    assert "synthetic: for benchmarks only" in g.fields["general.description"]
    tokens = g.fields["tokenizer.ggml.tokens"]
    assert len(tokens) == r.vocab == 400 and r.tokenizer_tokens < 400          # padded to the shape's vocabulary
    assert tokens[-1] == "<|synthetic_unused_399|>"
    assert r.n_bytes == r.path.stat().st_size


def test_q4_k_m_follows_llama_cpps_mix():
    # use_more_bits on 16 layers (llama-quant.cpp): the first and last eighth, and every third from the second
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert matrix_type("Q4_K_M", "attn_v", 4, 16, 2048) == "Q6_K"
    assert matrix_type("Q4_K_M", "attn_v", 5, 16, 2048) == "Q4_K"
    assert matrix_type("Q4_K_M", "ffn_down", 15, 16, 8192) == "Q6_K"
    assert matrix_type("Q4_K_M", "attn_q", 0, 16, 2048) == "Q4_K"
    assert matrix_type("Q4_K_M", "output", 0, 16, 2048) == "Q6_K"
    assert matrix_type("Q4_K_M", "token_embd", 0, 16, 2048) == "Q4_K"
    # rows of 1152 (Gemma 3 1B) are not whole 256-blocks: llama.cpp's fallbacks
    assert matrix_type("Q4_K_M", "attn_q", 0, 26, 1152) == "Q5_0"
    assert matrix_type("Q4_K_M", "output", 0, 26, 1152) == "Q8_0"
    assert matrix_type("Q4_0", "output", 0, 16, 2048) == "Q4_0"


def test_the_shape_table_gives_the_published_parameter_counts():
    # the models' published counts (safetensors metadata on the hub): the table and the tensor plan agree with them
    published = {"Llama-3.2-1B": 1_235_814_400, "Llama-3.2-3B": 3_212_749_824, "Llama-3.1-8B": 8_030_261_248,
                 "Qwen2.5-7B": 7_615_616_512, "Gemma-3-1B": 999_885_952}
    for name, n in published.items():
        s = SHAPES[name]
        assert sum(math.prod(t.shape) for t in plan_tensors(s, "Q4_0", s.vocab)) == n, name
    assert shape_named("llama-3.2-1b") is SHAPES["Llama-3.2-1B"]
    with pytest.raises(ConfigError, match="unknown shape 'Llama-9B'"):
        shape_named("Llama-9B")


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_random_blocks_dequantize_to_the_asked_spread_around_zero(type_name):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    b = BLOCK_TYPES[type_name]
    raw = random_blocks(np.random.default_rng(0), type_name, 4096, DEFAULT_STD)          # [4096, bytes per block]
    w = dequantize(raw.reshape(-1, 8 * b.size), GGMLQuantizationType[type_name]).ravel()
    assert w.size == 4096 * b.block and np.isfinite(w).all()
    # std: the analytic E[w^2] of the layout; fp16 rounding of d (2^-11) and sampling (>= 131072 weights) move it
    # by well under 5 %
    assert abs(w.std() / DEFAULT_STD - 1) < 0.05, w.std()
    assert abs(w.mean()) < 0.05 * DEFAULT_STD, w.mean()


def test_memory_is_bounded_by_a_chunk_not_by_the_file(tmp_path, tokenizer_gguf):
    # the tokenizer's own size (a few hundred tokens): what remains is the writing
    shape = SynthShape("small", "llama", 1024, 2, 8, 2, 128, 3072, 0, False, 10000.0, 1e-5, 512, "test")
    parse_gguf(tokenizer_gguf)                    # the tokenizer's metadata parsed outside the measurement
    tracemalloc.start()
    try:
        r = write_synthetic_gguf(shape, "Q8_0", tmp_path / "small.gguf", tokenizer_gguf, vocab="tokenizer",
                                 chunk_bytes=64 << 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    biggest = max(t.n_bytes for t in plan_tensors(shape, "Q8_0", r.vocab))
    assert r.n_bytes > 20e6 and biggest > 3e6
    assert peak < biggest / 8, (peak, biggest)    # a chunk (64 KiB) and the metadata, not a tensor


@needs_libllama
@pytest.mark.parametrize("arch,fmt,tied", CASES)
def test_libllama_loads_and_decodes_with_finite_logits(synth_file, arch, fmt, tied):
    import llama_cpp

    r = synth_file(arch, fmt, tied)
    llm = llama_cpp.Llama(str(r.path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    try:
        assert llm.n_vocab() == r.vocab
        llm.eval([1, 5, 9, 2, 7])
        logits = np.asarray(llm.scores[:5])                                  # [5, vocab]
        assert logits.shape == (5, r.vocab) and np.isfinite(logits).all()
        assert logits.std() > 1e-3                                           # not collapsed to a constant
    finally:
        llm.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_leaplm_loads_and_decodes_a_llama_shape(synth_file, fmt):
    from leaplm.engine.engine import Engine
    from leaplm.models import load_model

    r = synth_file("llama", fmt)
    lm = load_model(str(r.path), quantization="gguf" if fmt != "Q4_K_M" else None, backend="torch")
    assert lm.model.vocab_size == r.vocab
    cache = lm.model.new_cache(1, 32)
    logits = lm.model.forward(torch.tensor([[1, 5, 9, 2]]), cache)              # [1, 4, vocab]
    assert logits.shape == (1, 4, r.vocab) and torch.isfinite(logits).all()
    out = Engine(model=lm, method="none").generate([1, 5, 9], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                                              ignore_eos=True))
    assert len(out.token_ids) == 6


def test_synthetic_files_are_refused_for_text_unless_allowed(synth_file, tokenizer_gguf):
    r = synth_file("llama", "Q8_0")
    with pytest.raises(ConfigError, match="random weights .*for benchmarks only.*--allow-synthetic"):
        refuse_synthetic(str(r.path), allow=False)
    refuse_synthetic(str(r.path), allow=True)
    refuse_synthetic(tokenizer_gguf, allow=False)                         # a real file passes


def test_bad_requests_are_refused_naming_the_field(tmp_path, tokenizer_gguf):
    with pytest.raises(ConfigError, match="unknown format 'Q5_K_M'"):
        write_synthetic_gguf(tiny("llama"), "Q5_K_M", tmp_path / "x.gguf", tokenizer_gguf)
    with pytest.raises(ConfigError, match="fewer than the tokenizer's"):
        write_synthetic_gguf(tiny("llama", vocab=100), "Q4_0", tmp_path / "x.gguf", tokenizer_gguf)
    with pytest.raises(ConfigError) as e:
        write_synthetic_gguf(tiny("llama"), "Q4_0", tmp_path / "x.gguf", tmp_path / "absent.gguf")
    assert e.value.field == "tokenizer_from"
    assert not (tmp_path / "x.gguf").exists()


def test_the_command_refuses_unknown_shapes_and_formats(tmp_path):
    from typer.testing import CliRunner

    from leaplm.cli import app

    r = CliRunner().invoke(app, ["models", "synth", "Llama-9B", "--out", str(tmp_path / "x.gguf")])
    assert r.exit_code != 0 and "unknown shape 'Llama-9B'" in r.output
    r = CliRunner().invoke(app, ["models", "synth", "Llama-3.2-1B", "--format", "Q2_K", "--out",
                                 str(tmp_path / "x.gguf")])
    assert r.exit_code != 0 and "--format" in r.output


def test_generate_refuses_a_synthetic_file_unless_allowed(synth_file):
    from typer.testing import CliRunner

    from leaplm.cli import app

    path = str(synth_file("llama", "Q8_0").path)
    args = ["generate", "--model", path, "--method", "none", "--max-new-tokens", "3", "--ignore-eos", "hello"]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert r.exit_code != 0 and "synthetic: for benchmarks only" in r.output and "--allow-synthetic" in r.output
    r = CliRunner().invoke(app, args + ["--allow-synthetic", "--json"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output


def test_a_seed_gives_the_same_file_and_another_seed_another(tmp_path, tokenizer_gguf):
    a, b, c = (write_synthetic_gguf(tiny("llama"), "Q4_0", tmp_path / f"{n}.gguf", tokenizer_gguf, seed=s).path
               for n, s in (("a", 0), ("b", 0), ("c", 1)))
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()

"""A quantized model through the engine: logits equal the same model with the dequantized weights in fp32 (to a
float tolerance), greedy output of every method is token-identical to plain decoding of the same quantized
model, and bad requests are refused naming --quantization."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import load_model
from leaplm.quant.apply import linear_names, quantize_model
from leaplm.quant.formats import dequantize



def _root_conftest():
    """tests/conftest.py by path: `from conftest import` finds whichever conftest pytest loaded first (tests/heads
    and tests/server have their own)."""
    import importlib.util

    name = "leaplm_tests_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "conftest.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


write_noisy_copy = _root_conftest().write_noisy_copy
write_tiny_llama = _root_conftest().write_tiny_llama

LOOP = [1, 2, 3, 4, 5] * 3
PROMPTS = [LOOP, [7, 3, 9, 3, 7, 1], [4]]
METHODS = {
    "draft": dict(method="draft", k=4),
    "ngram": dict(method="ngram", k=4),
    "suffix": dict(method="suffix", k=6),
    "lookahead": dict(method="lookahead", k=6, window=3, ngram_size=3, guess_set=3),
    "layerskip": dict(method="layerskip", k=5, skip_layers=[1, 2], skip_confidence=0.0),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = write_tiny_llama(tmp_path_factory.mktemp("qt"), vocab=16, layers=4, seed=3)
    return target, write_noisy_copy(target, tmp_path_factory.mktemp("qd"), noise=0.3, seed=1)


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request, dirs):
    t, d = dirs
    return request.param, load_model(t, quantization=request.param), load_model(d, quantization=request.param)


def greedy(n=40):
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def test_every_linear_is_quantized_and_fp_copies_freed(quantized):
    fmt, target, _ = quantized
    m = target.model
    assert sorted(m.quantized) == sorted(linear_names(m))
    assert all(m.get_parameter(n).numel() == 0 for n in linear_names(m))


class ReferenceLinear:
    """The kernel's arithmetic in float64 (tests/quant/test_linear.py's int8_reference) as a model's linear."""

    def __init__(self, qw):
        self.weight = qw

    def __call__(self, x, bias=None):
        from test_linear import int8_reference

        y, _ = int8_reference(self.weight, x.reshape(-1, x.shape[-1]).float())
        y = y.float().view(*x.shape[:-1], -1)
        return y if bias is None else y + bias


def test_logits_match_the_reference_arithmetic(quantized, dirs):
    """The whole model through the kernel vs the same model through ReferenceLinear: only fp32 rounding differs
    (and the activation roundings it can tip: one int8 step of a block is 1/127 of its largest activation)."""
    if quantized[1].model.quantized["lm_head.weight"].backend != "extension":
        pytest.skip("the C++ extension is unavailable here")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    fmt, target, _ = quantized
    ref = load_model(dirs[0], quantization=fmt)
    ref.model.quantized = {n: ReferenceLinear(lin.weight) for n, lin in ref.model.quantized.items()}
    ref.model._fast = None
    ids = torch.tensor([LOOP])
    a = target.model(ids, target.model.new_cache(1, 64))
    b = ref.model(ids, ref.model.new_cache(1, 64))
    scale = b.abs().max().item()
    assert torch.allclose(a, b, rtol=0, atol=scale / 127 / 8), (a - b).abs().max() / scale
    # the activation quantization is real: the dequantized weights on fp32 activations differ by more
    deq = load_model(dirs[0])
    with torch.no_grad():
        for name, lin in target.model.quantized.items():
            deq.model.get_parameter(name).copy_(dequantize(lin.weight))
    c = deq.model(ids, deq.model.new_cache(1, 64))
    assert (c - a).abs().max() > 10 * (a - b).abs().max()
    assert torch.allclose(a, c, rtol=0, atol=scale / 8)


@pytest.mark.parametrize("name", METHODS)
def test_greedy_every_method_equals_none_on_the_quantized_model(name, quantized):
    fmt, target, draft = quantized
    plain = Engine(target, method="none")
    eng = Engine(target, draft=draft if name == "draft" else None, adaptive_k=False, **METHODS[name])
    drafted = accepted = 0
    for prompt in PROMPTS:
        out = eng.generate(prompt, greedy())
        assert out.token_ids == plain.generate(prompt, greedy()).token_ids, (fmt, name, prompt)
        drafted, accepted = drafted + out.stats.draft_tokens, accepted + out.stats.accepted_tokens
    assert drafted > 0 and accepted > 0, (drafted, accepted)   # speculation really ran


def test_bad_quantization_is_refused_by_name(dirs):
    with pytest.raises(ConfigError) as e:
        load_model(dirs[0], quantization="int3")
    assert e.value.field == "quantization" and "int3" in e.value.message
    with pytest.raises(ConfigError) as e:
        load_model(dirs[0], quantization="gguf")
    assert e.value.field == "quantization" and "not a GGUF file" in e.value.message
    with pytest.raises(ConfigError) as e:
        Engine(dirs[0], method="none", quantization="fp8")
    assert e.value.field == "quantization"


@pytest.mark.parametrize("qtype,tied", [("Q8_0", False), ("Q4_0", True), ("Q4_1", False), ("Q4_K_M", True)])
def test_gguf_blocks_are_used_as_stored(tmp_path, qtype, tied):
    """--quantization gguf computes on the file's own integers and scales (every linear, the tied head too), and
    int8 / int4 take the file's blocks when they are already in that format. Greedy chains (ngram) and trees
    (lookahead) equal plain decoding on them."""
    pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from gguf_writer import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path, qtype=qtype, tied=tied)
    fp = load_model(path, backend="torch")                     # dequantized by the loader
    lm = load_model(path, quantization="gguf")
    assert sorted(lm.model.quantized) == sorted(linear_names(lm.model))
    for name, lin in lm.model.quantized.items():               # exactly the file's values, not requantized
        have = fp.model.get_parameter(name).detach()
        assert torch.allclose(torch.cat([dequantize(p.weight) for p in lin.parts]), have, rtol=0,
                              atol=4 * torch.finfo(torch.float32).eps * have.abs().max().item()), name
    fmt = "int8" if qtype == "Q8_0" else "int4"
    same = load_model(path, quantization=fmt)
    for name, lin in same.model.quantized.items():
        mine = lm.model.quantized[name].parts
        if len(mine) == 1 and mine[0].weight.fmt == fmt:      # a Q4_K_M file holds int8, int4 and int6 matrices
            assert torch.equal(lin.weight.q, mine[0].weight.q), name
    plain = Engine(lm, method="none")
    engines = [Engine(lm, method="ngram", k=4, adaptive_k=False),
               Engine(lm, method="lookahead", k=6, window=3, ngram_size=3, guess_set=3, adaptive_k=False)]
    for prompt in ["the quick brown fox the quick brown fox the", "def add(a, b):"]:
        want = plain.generate(prompt, greedy(20)).token_ids
        for eng in engines:
            assert eng.generate(prompt, greedy(20)).token_ids == want, eng.spec.method


def test_gguf_type_without_a_kernel_runs_dequantized_and_is_named(tmp_path, caplog):
    pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from gguf_writer import write_tiny_gguf

    path, _ = write_tiny_gguf(tmp_path, qtype="F16")
    with caplog.at_level("WARNING"):
        lm = load_model(path, quantization="gguf", backend="torch")
    assert not lm.model.quantized
    lines = [r.getMessage() for r in caplog.records if "stay in" in r.getMessage()]
    assert len(lines) == 1 and "GGUF type F16" in lines[0], lines


def test_cli_generate_and_serve_take_quantization(dirs):
    import json

    from typer.testing import CliRunner

    from leaplm.cli import app

    run = lambda *a: CliRunner().invoke(app, list(a))
    plain = run("generate", "t1 t2 t3 t4 t5 t1 t2", "--model", dirs[0], "--method", "none", "--max-new-tokens", "12",
                "--quantization", "int4", "--json", "--ignore-eos")
    spec = run("generate", "t1 t2 t3 t4 t5 t1 t2", "--model", dirs[0], "--method", "ngram", "--fixed-k",
               "--max-new-tokens", "12", "--quantization", "int4", "--json", "--ignore-eos")
    assert plain.exit_code == 0 and spec.exit_code == 0, plain.output + spec.output
    ids = lambda r: json.loads(r.stdout)["samples"][0]["token_ids"]
    assert ids(plain) == ids(spec) and len(ids(plain)) == 12
    for cmd in (["generate", "t1", "--model", dirs[0], "--method", "none"], ["serve", "--model", dirs[0]]):
        bad = run(*cmd, "--quantization", "q3")
        assert bad.exit_code == 2 and "--quantization" in bad.output and "q3" in bad.output, bad.output


def test_no_extension_falls_back_to_torch_and_says_why(monkeypatch, caplog):
    from leaplm.kernels import build

    monkeypatch.setenv("LEAPLM_NO_EXTENSION", "1")
    monkeypatch.setattr(build, "_state", {})
    assert build.unavailable_reason() == "LEAPLM_NO_EXTENSION=1"
    with caplog.at_level("WARNING"):
        assert build.load() is None
    assert "LEAPLM_NO_EXTENSION=1" in caplog.text and "pure-PyTorch" in caplog.text
    from leaplm.quant.formats import quantize
    from leaplm.quant.linear import QuantizedLinear

    assert QuantizedLinear(quantize(torch.randn(4, 32), "int8")).backend == "torch"

"""The output layer's argmax in the kernel (kernels/driver.h qlinear_argmax, QuantizedLinear.argmax): the index of
each token's largest output without writing the outputs.

  exact     it equals torch.argmax of the kernel's own outputs (qlinear: the same products, so the same bits) for
            every format, token count and a row count spanning several slabs of 512 rows and a partial row group
  reference it equals torch.argmax of the dequantized weights times the fp32 activations wherever that maximum
            stands above the runner-up by more than the kernel's error bound (tests/quant/test_linear.py's
            module docstring: the activation rounding sum_g a_g / 2 * sum_{j in g} |w_j|, plus the summation-order
            term (2 K + 2) eps |x| @ |W|^T, on both outputs)
  ties      identical rows give identical bits: the lowest index wins, within a slab and across slabs, as torch's
  control   the same checks fail for a reduction that keeps the last maximum, and for the argmax of other weights
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from leaplm.kernels.build import unavailable_reason
from leaplm.quant.formats import BLOCK, dequantize, quantize
from leaplm.quant.linear import QuantizedLinear, pack_gguf

EPS = torch.finfo(torch.float32).eps
needs_ext = pytest.mark.skipif(unavailable_reason() is not None,
                               reason=f"C++ extension cannot be built here: {unavailable_reason()}")
N = 3 * 512 + 5                        # three slabs of 64 row groups and a partial group


def weights(fmt: str, n: int = N, K: int = 128, seed: int = 0) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    return QuantizedLinear(quantize(torch.randn(n, K, generator=g), fmt), "extension")


def gguf_weights(ggml_type: str, n: int = N - 5, K: int = 128, seed: int = 0) -> QuantizedLinear:
    """A GGUF file's Q8_0 / Q4_0 blocks packed with their fp16 scales (pack_gguf), the kernel's other scale type."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    w = torch.randn(n, K, generator=torch.Generator().manual_seed(seed)).numpy()
    raw = gguf_quantize(w, GGMLQuantizationType[ggml_type])            # [n, bytes per row] uint8
    return QuantizedLinear.from_packed(pack_gguf([np.asarray(raw)], ggml_type))


def error_bound(lin: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """[T, N]: how far the kernel's output may be from the dequantized weights times the fp32 activations."""
    w = dequantize(lin.weight)                                          # [N, K]
    T, K = x.shape
    a = x.view(T, K // BLOCK, BLOCK).abs().amax(-1) / 127               # [T, G]: the activation scales
    wsum = w.abs().view(w.shape[0], K // BLOCK, BLOCK).sum(-1)          # [N, G]
    return (a / 2) @ wsum.T + (2 * K + 2) * EPS * (x.abs() @ w.abs().T)


def clear_winners(ref: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """[T] bool: the reference's maximum beats every other output by more than both their bounds."""
    top = ref.argmax(-1, keepdim=True)                                  # [T, 1]
    gap = ref.gather(1, top) - ref                                      # [T, N]
    margin = bound.gather(1, top) + bound
    ok = (gap > margin) | (torch.arange(ref.shape[1]) == top)
    return ok.all(-1)


@needs_ext
@pytest.mark.parametrize("make", [lambda: weights("int8"), lambda: weights("int4"), lambda: weights("int6"),
                                  lambda: gguf_weights("Q8_0"), lambda: gguf_weights("Q4_0")],
                         ids=["int8", "int4", "int6", "Q8_0-fp16", "Q4_0-fp16"])
@pytest.mark.parametrize("T", [1, 7, 16, 32, 45])
def test_argmax_is_torch_argmax_of_the_kernel_s_outputs_and_of_the_reference_where_clear(make, T):
    lin = make()
    x = torch.randn(T, lin.packed.q.shape[1] * BLOCK, generator=torch.Generator().manual_seed(T)) * 3
    got = lin.argmax(x)                                                 # [T]
    assert got.dtype == torch.long and got.shape == (T,)
    assert torch.equal(got, lin(x).argmax(-1))
    ref = F.linear(x.double(), dequantize(lin.weight).double()).float()     # [T, N]
    clear = clear_winners(ref, error_bound(lin, x))
    assert clear.sum() >= T // 2, "too few clear maxima for the reference check to say anything"
    assert torch.equal(got[clear], ref.argmax(-1)[clear])
    # control: the argmax of other weights agrees on few tokens
    other = weights("int8", lin.out_features, x.shape[1], seed=1)
    assert (other.argmax(x) != got).float().mean() > 0.5


@needs_ext
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_ties_go_to_the_lowest_index_within_and_across_slabs(fmt):
    K = 128
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(4, K, generator=g)
    best = torch.sign(x[0]) * 4                                         # a row far above the others for token 0
    # token 0's maximum at rows 700 and 900 (one slab) and 1300 (the next); token 1's at 5 and 1540 (the last,
    # in the partial group); identical rows give identical bits
    for r in (700, 900, 1300):
        w[r] = best
    w[5] = w[1540] = torch.sign(x[1]) * 4
    lin = QuantizedLinear(quantize(w, fmt), "extension")
    y = lin(x)
    assert y[0, 700] == y[0, 900] == y[0, 1300] and y[1, 5] == y[1, 1540]
    got = lin.argmax(x)
    assert got[:2].tolist() == [700, 5]
    assert torch.equal(got, y.argmax(-1))
    # control: the last maximum (a reduction that lets later rows win ties) differs
    last = y.shape[1] - 1 - y.flip(-1).argmax(-1)
    assert last[:2].tolist() == [1300, 1540]


@needs_ext
def test_the_bias_is_added_as_qlinear_adds_it_and_a_nan_output_wins_as_in_torch():
    lin = weights("int8", n=1100, K=64)
    p, mod, path = lin.packed, lin.ext.module, lin.ext.path
    x = torch.randn(3, 64)
    bias = torch.randn(1100) * 10
    bias[[600, 900]] = float("nan")                     # NaN outputs at 600 and 900 (the kernel's products are finite)
    values, got = mod.qlinear_argmax(x, p.q, p.scale, p.minv, bias, p.rows, path)
    y = mod.qlinear(x, p.q, p.scale, p.minv, bias, p.rows, path)
    assert torch.equal(got, y.argmax(-1)) and got.tolist() == [600] * 3 and values.isnan().all()
    bias[[600, 900]] = 0.0
    values, got = mod.qlinear_argmax(x, p.q, p.scale, p.minv, bias, p.rows, path)
    y = mod.qlinear(x, p.q, p.scale, p.minv, bias, p.rows, path)
    assert torch.equal(got, y.argmax(-1)) and torch.equal(values, y.amax(-1))


# ---- the engine: greedy rows whose logits nothing reads take the model's argmax alone ----------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Q4_K_M GGUF file on the kernel (Q4_K, Q6_K, Q5_0 and Q8_0 blocks; tests/models/gguf_writer.py)."""
    import sys
    from pathlib import Path

    from leaplm.models import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from gguf_writer import write_tiny_gguf

    return load_model(write_tiny_gguf(tmp_path_factory.mktemp("argmax"), "Q4_K_M", seed=2)[0], quantization="gguf")


PROMPT = "ab ab ab cd ab ab ab cd ab ab"           # repeats, so ngram and suffix find drafts


def generate(lm, method: str, **params):
    from leaplm.config import SamplingParams
    from leaplm.engine.engine import Engine

    engine = Engine(lm, method=method, k=4, adaptive_k=False)
    return engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, **params))


@pytest.fixture
def head_calls(monkeypatch):
    """Counts QuantizedLinear.argmax calls (the kernel's argmax head)."""
    calls = [0]
    real = QuantizedLinear.argmax

    def counted(self, x):
        calls[0] += 1
        return real(self, x)

    monkeypatch.setattr(QuantizedLinear, "argmax", counted)
    return calls


@needs_ext
@pytest.mark.parametrize("method", ["none", "ngram", "suffix"])
def test_greedy_tokens_are_the_same_with_the_argmax_head_on_and_off(tiny, method, head_calls, monkeypatch):
    from dataclasses import replace

    model_type = type(tiny.model)
    assert model_type.capabilities.argmax_head
    on = generate(tiny, method)
    assert head_calls[0] >= 1 and len(on.token_ids) == 24
    if method != "none":
        assert on.stats.draft_tokens > 0
    monkeypatch.setattr(model_type, "capabilities", replace(model_type.capabilities, argmax_head=False))
    before = head_calls[0]
    off = generate(tiny, method)
    assert head_calls[0] == before                               # the full logits, argmaxed by the verifier
    assert on.token_ids == off.token_ids


@needs_ext
def test_a_wrong_argmax_head_changes_the_tokens(tiny, monkeypatch):
    """Negative control: the identity above can fail (a head answering each position's runner-up)."""
    want = generate(tiny, "ngram").token_ids
    monkeypatch.setattr(QuantizedLinear, "argmax", lambda self, x: self(x).topk(2, dim=-1).indices[..., 1])
    assert generate(tiny, "ngram").token_ids != want


@needs_ext
@pytest.mark.parametrize("params", [{"logprobs": 2}, {"repetition_penalty": 1.3}], ids=["logprobs", "penalty"])
def test_rows_that_read_their_logits_get_them(tiny, params, head_calls):
    out = generate(tiny, "ngram", **params)
    assert head_calls[0] == 0 and len(out.token_ids) == 24

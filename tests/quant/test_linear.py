"""The quantized linear against a dequantized fp32 reference, the C++ kernel's fixed reduction order (a row's
result is bit-identical alone or with 15 other rows), its AVX2 and scalar paths, and the pure-PyTorch fallback.

Tolerance: both sides multiply the same dequantized fp32 weights by the same x and differ only in summation
order, so |y - y_ref| <= 2 K eps (|x| @ |W|^T) (the classical bound for two orders of a K-term fp32 sum);
int4's weights may also differ by one rounding of q * scale + min (fused or not), which adds eps |W|.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from leaplm.kernels.build import load, unavailable_reason
from leaplm.quant.formats import dequantize, quantize
from leaplm.quant.linear import QuantizedLinear

EPS = torch.finfo(torch.float32).eps
needs_ext = pytest.mark.skipif(unavailable_reason() is not None,
                               reason=f"C++ extension cannot be built here: {unavailable_reason()}")


def bound(x, w):
    K = w.shape[1]
    return (2 * K + 2) * EPS * (x.abs() @ w.abs().T)


def case(fmt, T, N=40, K=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    return quantize(w, fmt), torch.randn(T, K, generator=g), torch.randn(N, generator=g)


@pytest.mark.parametrize("backend", ["torch", pytest.param("extension", marks=needs_ext)])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("T", [1, 3, 8, 16, 37])
def test_matches_dequantized_reference(backend, fmt, T):
    qw, x, bias = case(fmt, T)
    lin = QuantizedLinear(qw, backend)
    assert lin.backend == backend
    w = dequantize(qw)
    ref = F.linear(x.double(), w.double(), bias.double()).float()
    y = lin(x, bias)
    assert y.shape == (T, qw.out_features) and y.dtype == torch.float32
    assert ((y - ref).abs() <= bound(x, w) + EPS * bias.abs()).all()
    # negative control: a weight off by one quantization step somewhere is far outside the bound
    w_bad = w.clone()
    w_bad[5, 7] += qw.scale[5, 0]
    assert not ((F.linear(x, w_bad, bias) - ref).abs() <= bound(x, w) + EPS * bias.abs()).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("extension", marks=needs_ext)])
def test_shapes_and_bf16_activations(backend):
    qw, x, _ = case("int4", 6)
    lin = QuantizedLinear(qw, backend)
    y = lin(x.view(2, 3, -1).bfloat16())
    assert y.shape == (2, 3, qw.out_features) and y.dtype == torch.bfloat16
    ref = F.linear(x.bfloat16().float(), dequantize(qw)).view(2, 3, -1)
    assert torch.allclose(y.float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())


@needs_ext
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_row_is_bit_identical_alone_or_with_15_others(fmt):
    qw, x, bias = case(fmt, 16, N=72, K=160, seed=3)
    lin = QuantizedLinear(qw, "extension")
    together = lin(x, bias)                                            # [16, N]
    for t in range(16):
        assert torch.equal(lin(x[t:t + 1], bias), together[t:t + 1]), t
    for T in (2, 5, 9):                                                # every register tile size, any offset
        assert torch.equal(lin(x[3:3 + T], bias), together[3:3 + T]), T
    # more than 16 rows go through the kernel 16 at a time: still row-independent
    big = torch.cat([x, x.flip(0), x[:7]])
    assert torch.equal(lin(big, bias)[:16], together)


@needs_ext
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_avx2_and_scalar_paths_agree_bit_for_bit(fmt):
    ext = load()
    if not ext.avx2:
        pytest.skip(f"the AVX2 path is not usable here ({ext.why})")
    qw, x, _ = case(fmt, 11, N=33, K=224, seed=4)
    minv = qw.minv if qw.minv is not None else qw.scale
    fast = ext.module.qlinear(x, qw.q, qw.scale, minv, None, fmt == "int4", True)
    slow = ext.module.qlinear(x, qw.q, qw.scale, minv, None, fmt == "int4", False)
    assert torch.equal(fast, slow)


@needs_ext
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_extension_and_fallback_agree(fmt):
    qw, x, bias = case(fmt, 9, seed=5)
    a, b = QuantizedLinear(qw, "extension")(x, bias), QuantizedLinear(qw, "torch")(x, bias)
    w = dequantize(qw)
    assert ((a - b).abs() <= 2 * bound(x, w) + 2 * EPS * bias.abs()).all()


def test_unknown_backend_is_refused():
    qw, _, _ = case("int8", 1)
    with pytest.raises(ValueError, match="backend"):
        QuantizedLinear(qw, "amx")

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

"""Block formats: round-to-nearest error bounds, GGUF blocks read as the gguf package dequantizes them, exact
row operations (fusing and permuting rows never touch the integers)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from leaplm.quant.formats import BLOCK, cat_rows, dequantize, from_gguf_blocks, quantize


@pytest.mark.parametrize("fmt,levels", [("int8", 127), ("int4", 15)])
def test_round_to_nearest_error_is_half_a_step(fmt, levels):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 4 * BLOCK, generator=g) * torch.rand(48, 1, generator=g) * 3
    qw = quantize(w, fmt)
    err = (dequantize(qw) - w).abs().reshape(48, 4, BLOCK)
    step = qw.scale.unsqueeze(-1)                                      # one quantization step per block
    # half a step, plus the fp32 rounding of q * scale (+ min): a few ulps of the block's largest magnitude
    slack = 4 * torch.finfo(torch.float32).eps * w.abs().reshape(48, 4, BLOCK).amax(-1, keepdim=True)
    assert (err <= step / 2 + slack).all()
    # negative control: one level coarser rounding breaks the bound
    coarse = torch.round(w.reshape(48, 4, BLOCK) / (2 * step)) * 2 * step
    assert ((coarse - w.reshape(48, 4, BLOCK)).abs() > step / 2 + slack).any()


def test_constant_and_zero_blocks_are_exact():
    w = torch.zeros(2, 2 * BLOCK)
    w[1, BLOCK:] = 0.75
    for fmt in ("int8", "int4"):
        assert torch.equal(dequantize(quantize(w, fmt)), w), fmt


def test_unknown_format_and_bad_shape_are_refused():
    with pytest.raises(ValueError, match="unknown format 'int3'"):
        quantize(torch.zeros(2, BLOCK), "int3")
    from leaplm.quant.formats import check_quantizable

    with pytest.raises(ValueError, match="multiple of 32"):
        check_quantizable(torch.zeros(2, 40), "layers.0.mlp.down_proj.weight")


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_as_the_gguf_package_does(ggml_type):
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    qt = GGMLQuantizationType[ggml_type]
    w = np.random.default_rng(0).standard_normal((6, 3 * BLOCK)).astype(np.float32)
    raw = gq.quantize(w, qt)                                           # [6, bytes per row] uint8
    ref = torch.from_numpy(gq.dequantize(raw, qt).astype(np.float32))
    qw = from_gguf_blocks(raw, ggml_type, (6, 3 * BLOCK))
    assert qw.fmt == ("int8" if ggml_type == "Q8_0" else "int4")
    # same fp16 scales, one fp32 rounding of q * d (+ m) each side
    tol = 2 * torch.finfo(torch.float32).eps * ref.abs().max()
    assert torch.allclose(dequantize(qw), ref, rtol=0, atol=tol)


def test_row_ops_are_exact():
    g = torch.Generator().manual_seed(1)
    a, b = quantize(torch.randn(4, 64, generator=g), "int4"), quantize(torch.randn(3, 64, generator=g), "int4")
    fused = cat_rows([a, b])
    assert torch.equal(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]))
    perm = torch.tensor([6, 0, 3, 1, 5, 2, 4])
    assert torch.equal(dequantize(fused.rows(perm)), dequantize(fused)[perm])
    with pytest.raises(ValueError, match="formats"):
        cat_rows([a, quantize(torch.randn(2, 64), "int8")])

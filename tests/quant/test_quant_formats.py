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


def _writer():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import gguf_writer

    return gguf_writer


@pytest.mark.parametrize("ggml_type,fmt", [("Q5_0", "int8"), ("Q4_K", "int4"), ("Q6_K", "int6")])
def test_k_quant_and_q5_0_blocks_read_as_the_gguf_package_dequantizes_them(ggml_type, fmt):
    """Q5_0, Q4_K and Q6_K blocks become the kernel's formats without a rounding: dequantizing the result gives
    the gguf package's values bit for bit, for encoded weights and for arbitrary block bytes."""
    import gguf
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    g = np.random.default_rng(3)
    N, K = 9, 512
    x = (g.standard_normal((N, K)) * g.uniform(0.1, 3, (N, 1))).astype(np.float32)
    t = gguf.GGMLQuantizationType[ggml_type]
    enc = _writer().K_QUANTIZERS.get(ggml_type) or (lambda a: gguf_quantize(a, t))
    block, size = gguf.GGML_QUANT_SIZES[t]
    noise = g.integers(0, 256, (N, K // block, size), dtype=np.uint8)
    scale_bytes = {"Q5_0": [slice(0, 2)], "Q4_K": [slice(0, 2), slice(2, 4)], "Q6_K": [slice(208, 210)]}
    for s in scale_bytes[ggml_type]:                                   # finite fp16 scales, any integers
        noise[..., s] = np.float16(0.01).tobytes()[0], np.float16(0.01).tobytes()[1]
    for raw in (enc(x), noise.reshape(N, -1)):
        want = gguf_dequantize(raw, t).astype(np.float32)
        qw = from_gguf_blocks(raw, ggml_type, (N, K))
        assert qw.fmt == fmt and qw.in_features == K and qw.out_features == N
        assert np.array_equal(dequantize(qw).numpy().view(np.uint32), want.view(np.uint32))
    # the encoders are round to nearest: within a step of the weights (a sanity check of the fixture)
    assert np.abs(gguf_dequantize(enc(x), t) - x).max() < 0.2 * np.abs(x).max()
    # negative control: one integer nibble changed is seen
    raw = enc(x).copy()
    raw[0, size - 1] ^= 0x11 if ggml_type != "Q6_K" else 0
    raw[0, 0] ^= 0x11 if ggml_type == "Q6_K" else 0
    assert not np.array_equal(dequantize(from_gguf_blocks(raw, ggml_type, (N, K))).numpy(),
                              gguf_dequantize(enc(x), t))


def test_int6_rounds_to_half_a_step_per_16_weights():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 4 * BLOCK, generator=g) * torch.rand(8, 8, 1, generator=g).repeat_interleave(16, 1).view(8, -1)
    qw = quantize(w, "int6")
    assert qw.scale.shape == (8, 8) and qw.q.abs().max() <= 32
    err = (dequantize(qw) - w).abs().reshape(8, 8, 16)
    assert (err <= qw.scale.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    assert torch.equal(dequantize(cat_rows([qw.rows(torch.tensor([3])), qw.rows(torch.tensor([1]))])),
                       dequantize(qw)[[3, 1]])

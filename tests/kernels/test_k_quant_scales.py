"""K-quant scales held as the file holds them (quant/linear.py factor_k_scales; kernels/common.h): each block's scale
and minimum an int8 multiple of its super-block's fp16 d (and -dmin), widened and multiplied in the kernel.

  exact     the factored weight and the same weight with fp32 scales give the same bits on every path, every
            block size 1..32 (tile products included where AMX runs) and through the argmax head; unpacked, the
            same scales and minimums
  bytes     a block's scale and minimum take one byte each (plus the super scales' 2 bytes per 256 weights)
  control   a super scale that does not factor its blocks' scales (a non-finite d) packs with fp32 scales, and a
            factored weight read without its super scales is refused by the kernel, not misread
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from leaplm.kernels.build import load, unavailable_reason
from leaplm.quant.linear import pack_gguf_chunked, unpack

needs_ext = pytest.mark.skipif(unavailable_reason() is not None,
                               reason=f"C++ extension cannot be built here: {unavailable_reason()}")
K = 512


def k_blocks(ggml_type: str, n: int = 40, seed: int = 0) -> np.ndarray:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from gguf_writer import K_QUANTIZERS

    x = np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)
    x[3] *= 0                                   # a zero row: d = 0, so every multiple is 0
    return K_QUANTIZERS[ggml_type](x)


def both(ggml_type: str, n: int = 40):
    raw = k_blocks(ggml_type, n)
    return pack_gguf_chunked([(raw, ggml_type, None)], K), pack_gguf_chunked([(raw, ggml_type, None)], K,
                                                                                 factor=False)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K"])
def test_factored_scales_are_the_same_numbers_in_a_quarter_of_the_bytes(ggml_type):
    f, p32 = both(ggml_type)
    assert f.ss is not None and f.scale.dtype == torch.int8 and p32.ss is None and p32.scale.dtype == torch.float32
    assert (f.ms is not None) == (f.minv is not None) == (ggml_type == "Q4_K")
    a, b = unpack(f), unpack(p32)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
    assert (a.minv is None and b.minv is None) or torch.equal(a.minv, b.minv)
    assert f.scale.nbytes * 4 == p32.scale.nbytes
    assert f.ss.numel() * 8 * (2 if ggml_type == "Q6_K" else 1) == f.scale.numel()


@needs_ext
@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q6_K"])
def test_factored_and_fp32_scales_give_the_same_bits_on_every_path(ggml_type):
    from leaplm.kernels.build import PATHS

    ext = load()
    tiles = {int4: ext.module.amx_tokens(int4) for int4 in (False, True)}
    if ext.path == 3:                           # every block size as tile products too
        for int4 in tiles:
            ext.module.set_amx_tokens(int4, list(range(1, 33)))
    try:
        f, p32 = both(ggml_type, n=48)
        x = torch.randn(32, K, generator=torch.Generator().manual_seed(1))
        for T in range(1, 33):
            xt = x[:T].contiguous()
            ref = ext.module.qlinear(xt, p32.q, p32.scale, p32.minv, None, p32.rows, 0)
            ref_arg = ext.module.qlinear_argmax(xt, p32.q, p32.scale, p32.minv, None, p32.rows, 0)[1]
            for path in [p for p in PATHS if p <= ext.path]:
                y = ext.module.qlinear(xt, f.q, f.scale, f.minv, None, f.rows, path, **f.kernel_args())
                assert torch.equal(y, ref), (T, path)
                arg = ext.module.qlinear_argmax(xt, f.q, f.scale, f.minv, None, f.rows, path, **f.kernel_args())[1]
                assert torch.equal(arg, ref_arg), (T, path)
    finally:
        for int4, tokens in tiles.items():
            ext.module.set_amx_tokens(int4, tokens)


def test_a_super_scale_that_does_not_factor_keeps_fp32_scales():
    raw = k_blocks("Q4_K").copy()
    raw.reshape(40, K // 256, -1)[5, 1, 0:2] = np.array([np.inf], np.float16).view(np.uint8)   # d = inf
    p = pack_gguf_chunked([(raw, "Q4_K", None)], K)
    assert p.ss is None and p.scale.dtype == torch.float32


@needs_ext
def test_int8_scales_without_their_super_scales_are_refused():
    f, _ = both("Q4_K")
    ext = load()
    x = torch.randn(1, K)
    with pytest.raises(RuntimeError, match="sp"):
        ext.module.qlinear(x, f.q, f.scale, f.minv, None, f.rows, ext.path)
    with pytest.raises(RuntimeError, match="ss"):
        ext.module.qlinear(x, f.q, f.scale, f.minv, None, f.rows, ext.path, ss=f.ss[:1], ms=f.ms)

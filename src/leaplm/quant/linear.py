"""QuantizedLinear: a callable that stands in for F.linear(x, weight, bias) with a quantized weight.

Two paths compute it:
  extension  the C++ kernel (kernels/qlinear.cpp): reads each weight block once for up to 16 tokens, fixed
             reduction order (a row's result does not depend on how many rows share the call).
  torch      pure PyTorch: dequantize the weight per call and use F.linear (no compiler needed; slower, and
             its GEMM may round a row differently depending on the batch shape).
Blocks of more than 16 tokens (prefill, large trees) go through the kernel 16 rows at a time, so every row is
computed the same way whatever the block size.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .formats import QuantizedWeight, dequantize

log = logging.getLogger(__name__)

KERNEL_ROWS = 16          # tokens per kernel call (the kernel's register tiles cover 1..16)
BACKENDS = ("auto", "extension", "torch")


class QuantizedLinear:
    """y = x @ W.T (+ bias) for a QuantizedWeight W [N, K]; x [..., K] fp32 or bf16 -> y [..., N] in x's dtype."""

    def __init__(self, weight: QuantizedWeight, backend: str = "auto"):
        from ..kernels.build import load

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.weight = weight
        self.ext = load() if backend in ("auto", "extension") else None
        if backend == "extension" and self.ext is None:
            raise RuntimeError("the quantized-linear C++ extension is unavailable here (see the log for why)")
        self._int4 = weight.fmt == "int4"
        self._minv = weight.minv if weight.minv is not None else weight.scale   # unused by int8, must be a tensor

    @property
    def backend(self) -> str:
        return "extension" if self.ext is not None else "torch"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.ext is None:
            w = dequantize(self.weight).to(x.dtype)
            return F.linear(x, w, None if bias is None else bias.to(x.dtype))
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])                                   # [M, K]
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        b = None if bias is None else bias.float()
        w, run = self.weight, self.ext.module.qlinear
        M = x2.shape[0]
        if M <= KERNEL_ROWS:
            y = run(x2, w.q, w.scale, self._minv, b, self._int4, self.ext.avx2)
        else:
            y = torch.cat([run(x2[i:i + KERNEL_ROWS], w.q, w.scale, self._minv, b, self._int4, self.ext.avx2)
                           for i in range(0, M, KERNEL_ROWS)])
        return y.view(*shape[:-1], w.out_features).to(x.dtype)

"""QuantizedLinear: a callable that stands in for F.linear(x, weight, bias) with a quantized weight.

Two paths compute it:
  extension  the C++ kernel (kernels/qlinear.cpp): activations quantized to int8 per token and block of 32,
             8-bit integer dot products, each weight block read once for up to 32 tokens, fixed reduction order
             (a row's result does not depend on how many rows share the call, nor on the SIMD path).
  torch      pure PyTorch: dequantize the weight per call and use F.linear on fp32 activations (no compiler
             needed; slower, other numerics, and its GEMM may round a row differently depending on the batch
             shape).
Blocks of more than 32 tokens (prefill, large trees) go through the kernel 32 rows at a time, so every row is
computed the same way whatever the block size.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .formats import BLOCK, QuantizedWeight, dequantize

log = logging.getLogger(__name__)

KERNEL_ROWS = 32          # tokens per kernel call (one activation quantization, each weight block read once)
BACKENDS = ("auto", "extension", "torch")


GROUP = 8                 # rows per packed group: one 8-lane vector holds the same 4 weights of 8 rows


@dataclass
class PackedWeight:
    """A QuantizedWeight's integers and scales in the kernel's row-group layout (kernels/qlinear.cpp): the same
    numbers, reordered so that 8 rows' 4 consecutive weights are 32 contiguous bytes."""
    q: torch.Tensor              # uint8 [N8 / 8, G, 256] (int8, int6: the signed bytes) | [N8 / 8, G, 128] (int4)
    scale: torch.Tensor          # fp32 [N8 / 8, G, 8] | int6: [N8 / 8, G, 2 * 8] (the first half's 8, the second's)
    minv: torch.Tensor | None    # fp32 [N8 / 8, G, 8] for int4, None for int8
    rows: int                    # N (N8 = N rounded up to a multiple of 8; the padding rows are zero)


def pack(w: QuantizedWeight) -> PackedWeight:
    N, G = w.scale.shape[0], w.in_features // BLOCK
    NG = -(-N // GROUP)
    pad = NG * GROUP - N
    q = F.pad(w.q.view(torch.uint8), (0, 0, 0, pad))                   # [N8, K | K / 2]
    chunks = BLOCK // 8 if w.fmt == "int4" else BLOCK // 4             # 4-byte chunks per block (int4: 2 weights a byte)
    # [N8, G * chunks * 4] -> [NG, 8 rows, G, chunks, 4] -> [NG, G, chunks, 8 rows, 4]
    # moved as 4-byte words (the same bytes; a quarter of the elements for the strided copy)
    q = (q.contiguous().view(torch.int32).reshape(NG, GROUP, G, chunks).permute(0, 2, 3, 1).contiguous()
         .view(torch.uint8).reshape(NG, G, chunks * GROUP * 4))
    # [N, G'] -> [NG, G', 8] (int6: G' = 2 G, so a block's two halves' 8 rows follow each other)
    lay = lambda t: F.pad(t, (0, 0, 0, pad)).reshape(NG, GROUP, -1).transpose(1, 2).contiguous()   # noqa: E731
    return PackedWeight(q, lay(w.scale.float()), None if w.minv is None else lay(w.minv.float()), N)


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
        self.packed = pack(weight) if self.ext is not None else None

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
        p, run, path = self.packed, self.ext.module.qlinear, self.ext.path
        M = x2.shape[0]
        if M <= KERNEL_ROWS:
            y = run(x2, p.q, p.scale, p.minv, b, p.rows, path)
        else:
            y = torch.cat([run(x2[i:i + KERNEL_ROWS], p.q, p.scale, p.minv, b, p.rows, path)
                           for i in range(0, M, KERNEL_ROWS)])
        return y.view(*shape[:-1], p.rows).to(x.dtype)

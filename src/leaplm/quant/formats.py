"""Weight-only quantization formats: blocks of 32 weights along the input dimension, as GGUF stores them.

  int8: q int8 [N, K],          w = q * scale                 (GGUF Q8_0: symmetric, one scale per block)
  int4: q uint8 [N, K / 2],     w = q * scale + minv, q in 0..15 (GGUF Q4_1; Q4_0 is minv = -8 * scale)
        byte j of a block holds element j in its low nibble and element j + 16 in its high nibble (GGUF's order,
        so a file's Q4 blocks are copied, not repacked).
scale and minv are fp32 [N, K / 32]. Activations stay fp32: only the weights are quantized.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
FORMATS = ("int8", "int4")
# Bits per weight read from memory (fp32 scale and min per block of 32).
BITS_PER_WEIGHT = {"int8": 8 + 32 / BLOCK, "int4": 4 + 64 / BLOCK}


@dataclass
class QuantizedWeight:
    """One linear layer's weight [N, K] in a block format (see module docstring)."""
    fmt: str                     # "int8" | "int4"
    q: torch.Tensor              # int8 [N, K] | uint8 [N, K / 2]
    scale: torch.Tensor          # fp32 [N, K / 32]
    minv: torch.Tensor | None    # fp32 [N, K / 32] for int4, None for int8

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.scale.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes one forward reads for this weight."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minv) if t is not None)

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The weight with its output rows taken at `index` [M] (row permutations and slices stay exact)."""
        return QuantizedWeight(self.fmt, self.q[index].contiguous(), self.scale[index].contiguous(),
                               None if self.minv is None else self.minv[index].contiguous())


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output dimension (fusing q/k/v or gate/up)."""
    fmt = parts[0].fmt
    if any(p.fmt != fmt for p in parts):
        raise ValueError(f"cannot fuse weights of formats {[p.fmt for p in parts]}")
    return QuantizedWeight(fmt, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           None if fmt == "int8" else torch.cat([p.minv for p in parts]))


def check_quantizable(w: torch.Tensor, name: str) -> None:
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"{name}: weight {tuple(w.shape)} cannot be quantized in blocks of {BLOCK} "
                         f"(the input dimension must be a multiple of {BLOCK})")


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Round-to-nearest quantization of an fp weight [N, K] (K a multiple of 32), block by block."""
    N, K = w.shape
    b = w.detach().float().reshape(N, K // BLOCK, BLOCK)               # [N, G, 32]
    if fmt == "int8":
        scale = b.abs().amax(-1) / 127                                  # [N, G]
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round(b * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).reshape(N, K)
        return QuantizedWeight("int8", q, scale.contiguous(), None)
    if fmt == "int4":
        lo, hi = b.amin(-1), b.amax(-1)                                 # [N, G]
        scale = (hi - lo) / 15
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round((b - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)   # [N, G, 32]
        packed = q[..., :16] | (q[..., 16:] << 4)                       # [N, G, 16]
        return QuantizedWeight("int4", packed.reshape(N, K // 2).contiguous(), scale.contiguous(), lo.contiguous())
    raise ValueError(f"quantization: unknown format {fmt!r}; choose from {', '.join(FORMATS)}")


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The fp32 weight [N, K] the format represents (the reference every kernel is checked against)."""
    N, G = qw.scale.shape
    if qw.fmt == "int8":
        return (qw.q.reshape(N, G, BLOCK).float() * qw.scale.unsqueeze(-1)).reshape(N, G * BLOCK)
    p = qw.q.reshape(N, G, BLOCK // 2)
    q = torch.cat([p & 0x0F, p >> 4], dim=-1).float()                  # [N, G, 32]
    return torch.addcmul(qw.minv.unsqueeze(-1), q, qw.scale.unsqueeze(-1)).reshape(N, G * BLOCK)


def from_gguf_blocks(raw: "object", ggml_type: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF Q8_0 / Q4_0 / Q4_1 tensor's raw blocks (uint8 array [N, bytes per row]) as a QuantizedWeight,
    without dequantizing: the file's own integers and scales (fp16 in the file, exact in fp32)."""
    import numpy as np

    N, K = shape
    G = K // BLOCK
    a = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8)).reshape(N, G, -1)
    f16 = lambda cols: torch.from_numpy(np.ascontiguousarray(a[..., cols]).view(np.float16).astype(np.float32)
                                        .reshape(N, G))
    if ggml_type == "Q8_0":                 # block: d f16, 32 x int8
        q = torch.from_numpy(np.ascontiguousarray(a[..., 2:34]).view(np.int8)).reshape(N, K)
        return QuantizedWeight("int8", q, f16(slice(0, 2)), None)
    if ggml_type == "Q4_0":                 # block: d f16, 16 bytes of nibbles; w = (q - 8) d
        d = f16(slice(0, 2))
        q = torch.from_numpy(np.ascontiguousarray(a[..., 2:18])).reshape(N, K // 2)
        return QuantizedWeight("int4", q, d, -8 * d)
    if ggml_type == "Q4_1":                 # block: d f16, m f16, 16 bytes of nibbles; w = q d + m
        q = torch.from_numpy(np.ascontiguousarray(a[..., 4:20])).reshape(N, K // 2)
        return QuantizedWeight("int4", q, f16(slice(0, 2)), f16(slice(2, 4)))
    raise ValueError(f"GGUF tensor type {ggml_type} has no direct quantized form here")

"""Weight-only quantization formats: blocks of 32 weights along the input dimension, as GGUF stores them.

  int8: q int8 [N, K],          w = q * scale                 (GGUF Q8_0: symmetric, one scale per block)
  int4: q uint8 [N, K / 2],     w = q * scale + minv, q in 0..15 (GGUF Q4_1; Q4_0 is minv = -8 * scale)
        byte j of a block holds element j in its low nibble and element j + 16 in its high nibble (GGUF's order,
        so a file's Q4 blocks are copied, not repacked).
  int6: q int8 [N, K],          w = q * scale, q in -32..31, one scale per 16 weights (scale [N, K / 16])
scale and minv are fp32 [N, K / 32]. Activations stay fp32: only the weights are quantized.

GGUF types taken as stored (from_gguf_blocks), each an exact rewrite of the file's numbers:
  Q8_0 -> int8; Q5_0 -> int8 (the 5-bit integer minus 16); Q4_0, Q4_1 -> int4;
  Q4_K -> int4 (a super-block of 256 is 8 blocks of 32: scale = d * 6-bit scale, minv = -dmin * 6-bit min, both
          exact in fp32; nibbles reordered into the int4 order);
  Q6_K -> int6 (the 6-bit integer minus 32; scale = d * 8-bit sub-block scale, exact in fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
FORMATS = ("int8", "int4")            # what --quantization makes from full-precision weights
# Bits per weight read from memory (fp32 scale and min per block of 32; int6: two scales per block).
BITS_PER_WEIGHT = {"int8": 8 + 32 / BLOCK, "int4": 4 + 64 / BLOCK, "int6": 8 + 64 / BLOCK}
GGUF_TYPES = {"Q8_0": "int8", "Q5_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q6_K": "int6"}
QK_K = 256                            # weights per K-quant super-block
# bytes into a K-quant super-block where its fp16 d and dmin lie (llama.cpp's block_q4_K, block_q6_K; Q6_K has no
# dmin): its block scales are integer multiples of d, Q4_K's minimums of -dmin
K_SUPER_SCALES = {"Q4_K": (0, 2), "Q6_K": (208, None)}


@dataclass
class QuantizedWeight:
    """One linear layer's weight [N, K] in a block format (see module docstring)."""
    fmt: str                     # "int8" | "int4" | "int6"
    q: torch.Tensor              # int8 [N, K] | uint8 [N, K / 2] | int8 [N, K]
    scale: torch.Tensor          # fp32 [N, K / 32] | int6: [N, K / 16]
    minv: torch.Tensor | None    # fp32 [N, K / 32] for int4, None for int8

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1] * (2 if self.fmt == "int4" else 1)

    @property
    def nbytes(self) -> int:
        """Bytes one forward reads for this weight."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minv) if t is not None)

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The weight with its output rows taken at `index` [M] (row permutations and slices stay exact).
        index_select copies a few rows on the calling thread (advanced indexing starts torch's thread team, whose
        threads then spin beside the kernel's: a token embedding per forward)."""
        pick = lambda t: t.index_select(0, index.reshape(-1)).view(*index.shape, *t.shape[1:])
        return QuantizedWeight(self.fmt, pick(self.q), pick(self.scale), None if self.minv is None else pick(self.minv))


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output dimension (fusing q/k/v or gate/up)."""
    fmt = parts[0].fmt
    if any(p.fmt != fmt for p in parts):
        raise ValueError(f"cannot fuse weights of formats {[p.fmt for p in parts]}")
    return QuantizedWeight(fmt, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           None if parts[0].minv is None else torch.cat([p.minv for p in parts]))


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
    if fmt == "int6":                                                   # GGUF Q6_K's form (not a --quantization)
        h = b.reshape(N, 2 * (K // BLOCK), BLOCK // 2)                  # [N, 2G, 16]
        scale = h.abs().amax(-1) / 31
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round(h * inv.unsqueeze(-1)).clamp(-32, 31).to(torch.int8).reshape(N, K)
        return QuantizedWeight("int6", q, scale.contiguous(), None)
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
    if qw.fmt in ("int8", "int6"):                                    # int6: G counts blocks of 16
        return (qw.q.reshape(N, G, -1).float() * qw.scale.unsqueeze(-1)).reshape(N, -1)
    p = qw.q.reshape(N, G, BLOCK // 2)
    q = torch.cat([p & 0x0F, p >> 4], dim=-1).float()                  # [N, G, 32]
    return torch.addcmul(qw.minv.unsqueeze(-1), q, qw.scale.unsqueeze(-1)).reshape(N, G * BLOCK)


def from_gguf_blocks(raw: "object", ggml_type: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 array [N, bytes per row]) of a type in GGUF_TYPES as a QuantizedWeight,
    without dequantizing: the file's own integers and scales (fp16 in the file, exact in fp32)."""
    import numpy as np

    N, K = shape
    if ggml_type in ("Q4_K", "Q6_K"):
        return _from_k_blocks(np.ascontiguousarray(np.asarray(raw, dtype=np.uint8)).reshape(N, K // QK_K, -1),
                              ggml_type, N, K)
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
    if ggml_type == "Q5_0":                 # block: d f16, 32 high bits, 16 bytes of nibbles; w = (q - 16) d
        qh = np.ascontiguousarray(a[..., 2:6]).view("<u4")                        # [N, G, 1]
        qs = a[..., 6:22].astype(np.int16)                                          # [N, G, 16]
        hi = (qh >> np.arange(32, dtype=np.uint32)) & 1                             # [N, G, 32]: bit j of element j
        q = np.concatenate([qs & 0x0F, qs >> 4], -1) | (hi.astype(np.int16) << 4)   # [N, G, 32] in 0..31
        return QuantizedWeight("int8", torch.from_numpy((q - 16).astype(np.int8)).reshape(N, K),
                               f16(slice(0, 2)), None)
    raise ValueError(f"GGUF tensor type {ggml_type} has no direct quantized form here")


def _from_k_blocks(a, ggml_type: str, N: int, K: int) -> QuantizedWeight:
    """Q4_K / Q6_K super-blocks a [N, K / 256, bytes] (llama.cpp's block_q4_K, block_q6_K) as int4 / int6."""
    import numpy as np

    S = K // QK_K
    f16 = lambda b: np.ascontiguousarray(b).view(np.float16).astype(np.float32)   # noqa: E731  [N, S, 1]
    if ggml_type == "Q4_K":   # d f16, dmin f16, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        d_at, m_at = K_SUPER_SCALES["Q4_K"]
        d, dmin = f16(a[..., d_at:d_at + 2]), f16(a[..., m_at:m_at + 2])
        sc, qs = a[..., 4:16].astype(np.int32), a[..., 16:144]
        # 8 (scale, min) pairs of 6 bits (llama.cpp's get_scale_min_k4): pairs 0..3 in the low 6 bits of bytes
        # 0..3 / 4..7, pairs 4..7 from bytes 8..11's nibbles and the top 2 bits of bytes 0..3 / 4..7
        scale = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)], -1)
        mins = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], -1)
        # 4 chunks of 32 bytes: chunk c's low nibbles are block 2c, its high nibbles block 2c + 1
        c = qs.reshape(N, S, 4, 32)
        blocks = np.stack([c & 0x0F, c >> 4], 3).reshape(N, S, 8, 32)               # [N, S, 8 blocks, 32]
        packed = (blocks[..., :16] | (blocks[..., 16:] << 4)).astype(np.uint8)      # leaplm's int4 byte order
        s = (d * scale.astype(np.float32)).reshape(N, K // BLOCK)                    # exact: 11 x 6 bits
        m = -(dmin * mins.astype(np.float32)).reshape(N, K // BLOCK)
        return QuantizedWeight("int4", torch.from_numpy(packed.reshape(N, K // 2)), torch.from_numpy(s),
                               torch.from_numpy(m))
    if ggml_type == "Q6_K":   # 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d f16
        ql, qh = a[..., 0:128].astype(np.int16), a[..., 128:192].astype(np.int16)
        d_at = K_SUPER_SCALES["Q6_K"][0]
        sc, d = np.ascontiguousarray(a[..., 192:208]).view(np.int8).astype(np.float32), f16(a[..., d_at:d_at + 2])
        out = []
        for h in range(2):                  # each half of 128: ql 64 bytes, qh 32 bytes (llama.cpp's order)
            l, hb = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            out += [(l[..., :32] & 0x0F) | ((hb & 3) << 4), (l[..., 32:] & 0x0F) | (((hb >> 2) & 3) << 4),
                    (l[..., :32] >> 4) | (((hb >> 4) & 3) << 4), (l[..., 32:] >> 4) | (((hb >> 6) & 3) << 4)]
        q = (np.concatenate(out, -1) - 32).astype(np.int8)                          # [N, S, 256]
        s = (d * sc).reshape(N, K // 16)                                            # exact: 11 x 8 bits
        return QuantizedWeight("int6", torch.from_numpy(q.reshape(N, K)), torch.from_numpy(s), None)
    raise ValueError(f"GGUF tensor type {ggml_type} has no direct quantized form here")

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

import numpy as np
import torch
import torch.nn.functional as F

from .formats import BLOCK, QuantizedWeight, cat_rows, dequantize

log = logging.getLogger(__name__)

KERNEL_ROWS = 32          # tokens per kernel call (one activation quantization, each weight block read once)
BACKENDS = ("auto", "extension", "torch")


GROUP = 8                 # rows per packed group: one 8-lane vector holds the same 4 weights of 8 rows


@dataclass
class PackedWeight:
    """A QuantizedWeight's integers and scales in the kernel's row-group layout (kernels/qlinear.cpp): the same
    numbers, reordered so that 8 rows' 4 consecutive weights are 32 contiguous bytes."""
    q: torch.Tensor              # uint8 [N8 / 8, G, 256] (int8: the signed bytes) | [N8 / 8, G, 128] (int4) |
                                 # [N8 / 8, G, 192] (int6: pack_int6's 6-bit layout)
    scale: torch.Tensor          # fp32 [N8 / 8, G, 8] | int6: [N8 / 8, G, 2 * 8] (the first half's 8, the second's);
                                 # fp16 where a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks hold them so (pack_gguf)
    minv: torch.Tensor | None    # [N8 / 8, G, 8] in scale's type for int4, None for int8; int4 with one element
                                 # [1]: every minimum is that multiple of its scale (Q4_0: -8, so none is stored)
    rows: int                    # N (N8 = N rounded up to a multiple of 8; the padding rows are zero)
    # K-quants (factor_k_scales): scale and minv int8, each an integer multiple of the fp16 super-block scale of
    # its row and 256 weights here [N8 / 8, G / 8, 8] (the file's d; ms: -dmin), so a block's scale is 1 byte
    ss: torch.Tensor | None = None
    ms: torch.Tensor | None = None

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, minv) as fp32 in their packed layout (the products with the super-block scales: exact)."""
        def widen(t, sup):
            if sup is None:
                return None if t is None else t.float()
            per = t.shape[1] // sup.shape[1]                            # blocks (int6: half blocks) per super
            return t.float() * sup.float().repeat_interleave(per, dim=1)
        return widen(self.scale, self.ss), widen(self.minv, self.ms)

    def kernel_args(self) -> dict:
        """The super-block scales as the extension's qlinear takes them (none unless factored)."""
        return {} if self.ss is None else {"ss": self.ss, "ms": self.ms}


def _words_to_groups(b: torch.Tensor, NG: int) -> torch.Tensor:
    """[N8, G, chunks * 4] uint8 -> [NG, G, chunks * 8 * 4]: each 4-byte chunk of 8 rows side by side (moved as
    4-byte words: the same bytes, a quarter of the elements for the strided copy)."""
    N8, G, width = b.shape
    chunks = width // 4
    return (b.contiguous().view(torch.int32).reshape(NG, GROUP, G, chunks).permute(0, 2, 3, 1).contiguous()
            .view(torch.uint8).reshape(NG, G, chunks * GROUP * 4))


def _groups_to_words(q: torch.Tensor, rows: int) -> torch.Tensor:
    """_words_to_groups' inverse, the padding rows dropped: [NG, G, width] -> [rows, G, width] uint8."""
    NG, G, width = q.shape
    chunks = width // (GROUP * 4)
    return (q.contiguous().view(torch.int32).reshape(NG, G, chunks, GROUP).permute(0, 3, 1, 2).contiguous()
            .view(torch.uint8).reshape(NG * GROUP, G, chunks * 4)[:rows])


INT6_BLOCK_BYTES = 16 + 8         # one row's block of 32 six-bit weights: 16 nibble bytes, 8 bytes of 2-bit pairs


def pack_int6(q: torch.Tensor, NG: int) -> torch.Tensor:
    """int6 integers q int8 [N8, K] (-32..31, padding rows included) -> the kernel's 6-bit layout [NG, G, 192]:
    u = q + 32 (0..63) split as
      bytes   0..127  the low 4 bits, as int4's nibble chunks (byte e of a row's block: elements e and 16 + e)
      bytes 128..191  the top 2 bits, [2 vectors h, 8 rows, 4 bytes i]: bits 2k, 2k + 1 of byte (h, r, i) belong
                      to element 4 (4h + k) + i, so one shift and mask puts chunk 4h + k's top bits in place
    24 bytes a row and block, as the file's Q6_K holds them (its 16-weight scales apart)."""
    N8, K = q.shape
    G = K // BLOCK
    u = (q.to(torch.int16) + 32).to(torch.uint8).reshape(N8, G, BLOCK)            # [N8, G, 32]
    low = (u[..., :16] & 0x0F) | ((u[..., 16:] & 0x0F) << 4)                        # [N8, G, 16]
    top = ((u >> 4) & 3).reshape(N8, G, 2, 4, 4)                                    # [N8, G, h, k, i]
    pairs = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)   # [N8, G, 2, 4]
    return torch.cat([_words_to_groups(low, NG), _words_to_groups(pairs.reshape(N8, G, 8), NG)], dim=-1)


def unpack_int6(q: torch.Tensor, rows: int) -> torch.Tensor:
    """pack_int6's inverse: [NG, G, 192] -> int8 [rows, K] in -32..31."""
    low = _groups_to_words(q[..., :128], rows)                                      # [rows, G, 16]
    pairs = _groups_to_words(q[..., 128:], rows).reshape(rows, -1, 2, 1, 4)         # [rows, G, h, 1, i]
    top = (pairs >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)) & 3   # [rows, G, h, k, i]
    u = torch.cat([low & 0x0F, low >> 4], dim=-1) | (top.reshape(rows, -1, BLOCK) << 4)     # [rows, G, 32]
    return (u.to(torch.int16) - 32).to(torch.int8).reshape(rows, -1)


def pack(w: QuantizedWeight) -> PackedWeight:
    N, G = w.scale.shape[0], w.in_features // BLOCK
    NG = -(-N // GROUP)
    pad = NG * GROUP - N
    q = F.pad(w.q.view(torch.uint8), (0, 0, 0, pad))                   # [N8, K | K / 2]
    if w.fmt == "int6":
        q = pack_int6(q.view(torch.int8), NG)                          # [NG, G, 192]
    else:                                                              # [NG, G, chunks * 8 rows * 4]
        q = _words_to_groups(q.reshape(NG * GROUP, G, -1), NG)
    # [N, G'] -> [NG, G', 8] (int6: G' = 2 G, so a block's two halves' 8 rows follow each other)
    lay = lambda t: F.pad(t, (0, 0, 0, pad)).reshape(NG, GROUP, -1).transpose(1, 2).contiguous()   # noqa: E731
    return PackedWeight(q, lay(w.scale.float()), None if w.minv is None else lay(w.minv.float()), N)


def unpack(p: PackedWeight) -> QuantizedWeight:
    """pack's inverse: the QuantizedWeight [rows, K] whose packing is p (the padding rows dropped)."""
    NG, G, width = p.q.shape
    lay = lambda t: t.float().transpose(1, 2).reshape(NG * GROUP, -1)[:p.rows].contiguous()  # noqa: E731  [N, G']
    scale, minv = p.scales()
    if p.scale.shape[1] == 2 * G:                                                      # int6: a scale per 16
        return QuantizedWeight("int6", unpack_int6(p.q, p.rows), lay(scale), None)
    q = _groups_to_words(p.q, p.rows).reshape(p.rows, -1)                              # [N, K | K / 2]
    if minv is not None:
        minv = lay(scale) * minv if minv.numel() == 1 else lay(minv)                     # -8 s: exact in fp32
        return QuantizedWeight("int4", q.contiguous(), lay(scale), minv)
    return QuantizedWeight("int8", q.view(torch.int8), lay(scale), None)


def factor_k_scales(pk: PackedWeight, raw, ggml_type: str, K: int) -> PackedWeight:
    """pk (packed from the K-quant rows raw [N, bytes per row] with fp32 scales) with each scale and minimum held
    as an int8 multiple of its super-block's fp16 d (and -dmin): the same numbers (checked exactly) in a quarter of
    the bytes a forward streams. pk itself where the file's super scales do not factor them (a non-finite d)."""
    import numpy as np

    from .formats import K_SUPER_SCALES, QK_K

    N, S = raw.shape[0], K // QK_K
    NG = pk.q.shape[0]
    blocks = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8)).reshape(N, S, -1)
    def supers(at):                                   # [N, S] fp16 -> [NG, S, 8]
        d = torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16).reshape(N, S))
        return F.pad(d, (0, 0, 0, NG * GROUP - N)).reshape(NG, GROUP, S).transpose(1, 2).contiguous()
    def factor(t, sup):                               # t fp32 [NG, G', 8] -> int8 multiples of sup, or None
        per = t.shape[1] // S
        d = sup.float().repeat_interleave(per, dim=1)
        k = torch.where(d != 0, t / torch.where(d != 0, d, 1), 0).round()
        if not (torch.isfinite(d).all() and (k.abs() <= 127).all() and torch.equal(k * d, t)):
            return None
        return k.to(torch.int8)
    d_at, dmin_at = K_SUPER_SCALES[ggml_type]
    ss = supers(d_at)
    scale = factor(pk.scale, ss)
    ms = minv = None
    if pk.minv is not None:
        ms = -supers(dmin_at)                         # minv = -dmin * min: negating an fp16 is exact
        minv = factor(pk.minv, ms)
    if scale is None or (pk.minv is not None and minv is None):
        return pk
    return PackedWeight(pk.q, scale, minv, pk.rows, ss, ms)


PACK_CHUNK_WEIGHTS = 1 << 22      # weights per chunk of the packers (~4M: temporaries of tens of MB, pages dropped)


# a GGUF block as numpy reads it from the file: the scale (and minimum) in fp16, then the integers as 4-byte words
# (8 words of int8 for Q8_0; 4 words of nibble pairs for Q4_x), the bytes pack() moves in 4-byte words too
GGUF_BLOCKS = {"Q8_0": [("d", "<f2"), ("q", "<u4", (8,))],
               "Q4_0": [("d", "<f2"), ("q", "<u4", (4,))],
               "Q4_1": [("d", "<f2"), ("m", "<f2"), ("q", "<u4", (4,))]}


def pack_gguf(raws: list, ggml_type: str, rows: list | None = None, done=None) -> PackedWeight | None:
    """The PackedWeight of GGUF Q8_0 / Q4_0 / Q4_1 tensors stacked along their output rows (fused q/k/v, gate/up),
    moved from the file's blocks (raw uint8 views [N_i, bytes per row]) straight into the kernel's layout: one
    copy of the integers, none of them widened; the scales (and minimums) kept in fp16 as the file holds them, so a
    forward reads the file's bytes per weight (the kernel widens them exactly, so the products are those of
    pack(cat_rows([from_gguf_blocks(...)])), whose scales are fp32). `rows`: per tensor, None or an index [N_i]
    reordering its rows. done(i, r0, r1): called once rows [r0, r1) of tensor i (one not reordered) are copied,
    so that the caller can drop those pages of the file while the rest is packed.

    None for other types (Q5_0, the K-quants) and when the rows do not split into whole groups of 8 per tensor:
    the caller packs those through QuantizedWeight."""
    if ggml_type not in GGUF_BLOCKS:
        return None
    blk = np.dtype(GGUF_BLOCKS[ggml_type])
    blocks = [np.asarray(r, dtype=np.uint8).view(blk) for r in raws]          # [N_i, G] blocks, no copy
    if rows is not None:
        blocks = [b if r is None else b[np.asarray(r)] for b, r in zip(blocks, rows)]
    N = sum(b.shape[0] for b in blocks)
    if any(b.shape[0] % GROUP for b in blocks[:-1]) or N % GROUP:
        return None
    G = blocks[0].shape[1]
    NG, words = N // GROUP, blk["q"].shape[0]
    q = np.empty((NG, G, words, GROUP), np.uint32)                           # [NG, G, chunks, 8 rows]
    scale = np.empty((NG, G, GROUP), np.float16)
    minv = None if ggml_type == "Q8_0" else np.empty((NG, G, GROUP), np.float16)
    at = 0
    step = max(1, PACK_CHUNK_WEIGHTS // (G * BLOCK * GROUP))                  # row groups per chunk
    for i, b in enumerate(blocks):
        n = b.shape[0] // GROUP
        g = b.reshape(n, GROUP, G)                                             # [n, 8 rows, G]
        for c in range(0, n, step):
            e = min(n, c + step)
            q[at + c:at + e] = g["q"][c:e].transpose(0, 2, 3, 1)               # [e - c, G, chunks, 8 rows]
            scale[at + c:at + e] = g["d"][c:e].transpose(0, 2, 1)              # [e - c, G, 8]
            if ggml_type == "Q4_1":
                minv[at + c:at + e] = g["m"][c:e].transpose(0, 2, 1)
            if done is not None and (rows is None or rows[i] is None):
                done(i, c * GROUP, e * GROUP)
        at += n
    if ggml_type == "Q4_0":
        # w = (q - 8) d: the kernel takes each minimum as -8 times its widened scale (exact in fp32, as
        # from_gguf_blocks computes it), so none is stored or streamed
        minv = torch.tensor([-8.0], dtype=torch.float16)
    elif minv is not None:
        minv = torch.from_numpy(minv)
    return PackedWeight(torch.from_numpy(q.view(np.uint8).reshape(NG, G, words * GROUP * 4)),
                        torch.from_numpy(scale), minv, N)


def pack_gguf_chunked(parts: list[tuple], K: int, done=None, factor: bool = True) -> PackedWeight | None:
    """The PackedWeight of GGUF tensors of one kernel format (formats.GGUF_TYPES: Q4_K beside Q4_1 is int4 in both)
    stacked along their output rows, built a chunk of rows at a time: each chunk's blocks read from the file
    (formats.from_gguf_blocks), packed, and copied into the output, so the temporaries (a K-quant's unpacked
    integers are several times its blocks) are a chunk's, not a whole matrix's, and no unpacked copy is kept.
    parts: (raw uint8 [N_i, bytes per row], ggml type, None or an index [N_i] reordering its rows). The scales
    are fp32, as pack's, except for K-quants (factor): int8 multiples of the file's super-block scales
    (factor_k_scales). done(i, r0, r1): as pack_gguf's. None when a part other than the last has rows that do
    not split into groups of 8."""
    from .formats import GGUF_TYPES, K_SUPER_SCALES, from_gguf_blocks

    ns = [r.shape[0] for r, _, _ in parts]
    if any(n % GROUP for n in ns[:-1]) or len({GGUF_TYPES[t] for _, t, _ in parts}) != 1:
        return None
    chunk = max(GROUP, PACK_CHUNK_WEIGHTS // K // GROUP * GROUP)                # rows, whole groups
    NG = -(-sum(ns) // GROUP)
    # K-quants whose every part is one: the scales as int8 multiples of the super-block scales (factor_k_scales)
    k_only = factor and all(t in K_SUPER_SCALES for _, t, _ in parts)
    out: dict[str, torch.Tensor | None] = {}
    fields = ("q", "scale", "minv", "ss", "ms")
    at = 0                                                                        # row groups written
    for j, ((raw, ggml_type, rows), n) in enumerate(zip(parts, ns)):
        for i in range(0, n, chunk):
            sub = raw[i:i + chunk] if rows is None else raw[np.asarray(rows[i:i + chunk])]   # [c, bytes per row]
            pk = pack(from_gguf_blocks(sub, ggml_type, (sub.shape[0], K)))
            if k_only:
                pk = factor_k_scales(pk, sub, ggml_type, K)
                if pk.ss is None:                                                 # not factored: all fp32
                    return pack_gguf_chunked(parts, K, done, factor=False)
            if not out:                                                           # shapes known from the first
                out = {f: None if getattr(pk, f) is None else
                       torch.empty(NG, *getattr(pk, f).shape[1:], dtype=getattr(pk, f).dtype) for f in fields}
            g = pk.q.shape[0]
            for f in fields:
                if out[f] is not None:
                    out[f][at:at + g] = getattr(pk, f)
            at += g
            if done is not None and rows is None:
                done(j, i, i + sub.shape[0])
    return PackedWeight(out["q"], out["scale"], out["minv"], sum(ns), out["ss"], out["ms"])


class QuantizedLinear:
    """y = x @ W.T (+ bias) for a QuantizedWeight W [N, K]; x [..., K] fp32 or bf16 -> y [..., N] in x's dtype.

    On the extension it holds the kernel's layout alone (built from a QuantizedWeight, which it packs and lets go,
    or from_packed); its `weight` is then unpacked when asked for."""

    def __init__(self, weight: QuantizedWeight, backend: str = "auto"):
        from ..kernels.build import load

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.ext = load() if backend in ("auto", "extension") else None
        if backend == "extension" and self.ext is None:
            raise RuntimeError("the quantized-linear C++ extension is unavailable here (see the log for why)")
        self.packed = pack(weight) if self.ext is not None else None
        # one copy: the kernel's layout where it exists (`weight` unpacks it when something asks)
        self._weight: QuantizedWeight | None = weight if self.packed is None else None

    @classmethod
    def from_packed(cls, packed: PackedWeight) -> "QuantizedLinear":
        """A linear on the extension over weights already in its layout (pack_gguf); the extension must load."""
        from ..kernels.build import load

        self = cls.__new__(cls)
        self._weight, self.ext, self.packed = None, load(), packed
        if self.ext is None:
            raise RuntimeError("the quantized-linear C++ extension is unavailable here (see the log for why)")
        return self

    @property
    def weight(self) -> QuantizedWeight | None:
        """The weight [N, K] in its block format (unpacked from the kernel's layout when built from it)."""
        if self._weight is None and self.packed is not None:
            return unpack(self.packed)
        return self._weight

    @weight.setter
    def weight(self, w: QuantizedWeight | None) -> None:
        self._weight = w

    @property
    def nbytes(self) -> int:
        """Bytes one forward reads for this weight (its integers, scales and minimums; no padding rows)."""
        if self._weight is not None:
            return self._weight.nbytes
        p = self.packed
        per_row = sum(t[0].numel() * t.element_size() for t in (p.q, p.scale, p.minv, p.ss, p.ms)
                      if t is not None and t.numel() > 1) // GROUP
        return per_row * p.rows

    @property
    def fmt(self) -> str:
        """The block format ("int8" | "int4" | "int6"), read from the packed layout as unpack does."""
        if self._weight is not None:
            return self._weight.fmt
        p = self.packed
        return "int4" if p.minv is not None else "int6" if p.scale.shape[1] == 2 * p.q.shape[1] else "int8"

    @property
    def out_features(self) -> int:
        return self._weight.out_features if self._weight is not None else self.packed.rows

    @property
    def backend(self) -> str:
        return "extension" if self.ext is not None else "torch"

    @property
    def parts(self) -> list["QuantizedLinear"]:
        """The row blocks the C++ layer loop runs (quant/fused.py): this linear alone."""
        return [self]

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
            y = run(x2, p.q, p.scale, p.minv, b, p.rows, path, **p.kernel_args())
        else:
            y = torch.cat([run(x2[i:i + KERNEL_ROWS], p.q, p.scale, p.minv, b, p.rows, path, **p.kernel_args())
                           for i in range(0, M, KERNEL_ROWS)])
        return y.view(*shape[:-1], p.rows).to(x.dtype)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [...] long: the index of each row's largest output, torch.argmax's of self(x) (the first
        maximum), without writing the [..., N] outputs on the extension (kernels/driver.h qlinear_argmax: the
        same products, reduced per block of output rows)."""
        if self.ext is None:
            return self(x).argmax(-1)
        x2 = x.reshape(-1, x.shape[-1])                                 # [M, K]
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        p, run, path = self.packed, self.ext.module.qlinear_argmax, self.ext.path
        ids = [run(x2[i:i + KERNEL_ROWS], p.q, p.scale, p.minv, None, p.rows, path, **p.kernel_args())[1]
               for i in range(0, x2.shape[0], KERNEL_ROWS)]
        return (ids[0] if len(ids) == 1 else torch.cat(ids)).view(x.shape[:-1])      # [...]


class SplitLinear:
    """One linear whose row blocks are held in different formats (q/k/v of a Q4_K_M file: Q4_K q and k beside a
    Q6_K v, int4 and int6): each block is a QuantizedLinear, the outputs side by side. Every row is computed by its
    own block, so its result is the same bits as in a matrix of one format."""

    def __init__(self, parts: list[QuantizedLinear]):
        if len({p.backend for p in parts}) != 1:
            raise ValueError("the row blocks of a split linear must run on one backend")
        self.parts = parts
        self.formats = "/".join(p.fmt for p in parts)      # e.g. "int4/int6"

    @property
    def backend(self) -> str:
        return self.parts[0].backend

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)            # [..., N]
        return y if bias is None else y + bias.to(y.dtype)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [...] long (an output layer is one tensor, so never split: the outputs are written)."""
        return self(x).argmax(-1)


def fused_linear(parts: list[QuantizedWeight], backend: str = "auto") -> "QuantizedLinear | SplitLinear":
    """The linear of `parts` stacked along the output dimension (q/k/v, gate/up): one QuantizedLinear when they
    share a format, else a SplitLinear of each run of one format."""
    runs: list[list[QuantizedWeight]] = []
    for p in parts:
        if runs and runs[-1][0].fmt == p.fmt:
            runs[-1].append(p)
        else:
            runs.append([p])
    lins = [QuantizedLinear(cat_rows(r) if len(r) > 1 else r[0], backend) for r in runs]
    return lins[0] if len(lins) == 1 else SplitLinear(lins)

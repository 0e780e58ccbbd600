"""The cost of verifying on libllama: one forward over T = 1..32 tokens, per weight type, for `bench --roofline`.

A verify block of T tokens costs what llama.cpp's kernels make it cost for that T, and on quantized weights that
is far from flat (its one-token kernel reads each weight once; its block kernels do more work per weight). The
K policy learns the curve of the model it runs from the engine's calibration (engine/step.calibrate) and live
steps; this module reports it: the model's own file, and the same model requantized by libllama to the other
block types (Q4_0, Q4_1, Q8_0: every matrix in that type, the embedding and output included; and Q4_K_M, llama.cpp's
mix of Q4_K / Q6_K with Q5_0 / Q8_0 where a row is not a multiple of 256), each a
`BlockCurve`. The curve is of a whole forward (every layer, attention and the output projection), after `ctx`
cached tokens, one row and several rows, and beside it leaplm's own whole forward on the same file (PyTorch
backend: the int8 kernel on the file's own blocks, `--quantization gguf`; fp32 for F32/F16 files), so
the two engines' curves per weight type come from one run.
"""
from __future__ import annotations

import ctypes
import logging
import tempfile
from pathlib import Path

import torch

from ..models.backend_costs import forward_ms

log = logging.getLogger(__name__)

FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15}
MIXES = ("Q4_K_M",)       # llama.cpp's per-tensor mixes (K-quants where rows allow, its own picks elsewhere)
KERNEL_FILES = ("Q4_0", "Q4_1", "Q8_0", *MIXES)   # types whose file leaplm runs on its int8 kernel


def block_costs(model, tokens=tuple(range(1, 17)), rows: int = 1, ctx: int = 64, reps: int = 7) -> list[float]:
    """Median ms of one libllama forward over `rows` rows of T tokens each after `ctx` cached tokens per row, for
    each T in tokens; the T values interleaved per repeat (order reversed every other one), rolled back after
    each forward."""
    ms = forward_ms(model, tuple(tokens), ctx, reps, rows)
    return [ms[T] for T in tokens]


def main_weight_type(path: str) -> str:
    """The type holding most of the file's matrix bytes (what a 'Q4_1 file' means)."""
    from gguf import GGUFReader

    sizes: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        if len(t.shape) > 1 and t.name != "token_embd.weight":
            sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return max(sizes, key=sizes.get) if sizes else "F32"


def requantize(path: str, weight_type: str, out: str) -> str:
    """The GGUF file at `path` written with its matrices in `weight_type` by libllama's own quantizer (a mix such
    as Q4_K_M: the types llama.cpp picks per tensor for it)."""
    from ..models.llamacpp.binding import libllama

    lc = libllama()
    p = lc.llama_model_quantize_default_params()
    p.ftype = FTYPES[weight_type]
    p.allow_requantize = True
    p.pure = weight_type not in MIXES   # every matrix in weight_type (llama.cpp would pick Q6_K for the output)
    p.nthread = torch.get_num_threads()
    rc = lc.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {weight_type} failed ({rc})")
    return out


def libllama_curves(path: str, bandwidth_GBps: float, weight_types=("Q4_0", "Q4_1", "Q8_0", "Q4_K_M"),
                    tokens=tuple(range(1, 33)), rows=(1, 4), macs_per_s: float = 0.0) -> list:
    """BlockCurves of libllama's whole forward for the file's own weight type and `weight_types` (requantized),
    one per rows count (kernel 'llama.cpp forward' / 'llama.cpp forward, 4 rows'), each followed by leaplm's whole
    forward on the same file (kernel 'leaplm forward (int8 kernel)' or 'leaplm forward (fp32)')."""
    from ..models.llamacpp.model import LlamaCppLM
    from ..models.loading import load_model
    from .roofline import BlockCurve, forward_curve

    own = main_weight_type(path)
    out = []
    with tempfile.TemporaryDirectory(prefix="leaplm-requant-") as tmp:
        for wt in dict.fromkeys([own, *weight_types]):
            f = path if wt == own else requantize(path, wt, str(Path(tmp) / f"{wt}.gguf"))
            lm = LlamaCppLM(f)
            nbytes = lm.bytes_per_forward()
            for n in rows:
                ms = block_costs(lm, tokens, rows=n)
                out.append(BlockCurve(f"llama.cpp forward{'' if n == 1 else f', {n} rows'}", wt, list(tokens),
                                      [round(m, 3) for m in ms], [round(m / ms[0], 3) for m in ms], nbytes,
                                      round(nbytes / (bandwidth_GBps * 1e9) * 1e3, 3), []))
            del lm
            quantized = wt in KERNEL_FILES
            mine = load_model(f, quantization="gguf" if quantized else None, backend="torch")
            c = forward_curve(mine.model, wt, bandwidth_GBps, tokens, macs_per_s)
            q = getattr(mine.model, "quantized", {})
            how = next(iter(q.values())).backend if q else "fp32"
            c.kernel = f"leaplm forward ({ {'extension': 'int8 kernel', 'torch': 'dequantized per call'}.get(how, how)})"
            out.append(c)
            del mine
    return out

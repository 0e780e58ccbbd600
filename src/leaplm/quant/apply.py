"""Swap a native model's linear weights for quantized ones (`--quantization`, vLLM's flag name).

  int8 | int4   quantize every linear weight at load (round to nearest, blocks of 32; see formats.py). A GGUF
                tensor already in that format (Q8_0 for int8, Q4_0/Q4_1 for int4) is taken from the file as is.
  gguf          a GGUF file's own blocks: Q8_0/Q5_0 -> int8, Q4_0/Q4_1/Q4_K -> int4, Q6_K -> int6, exactly as
                stored (formats.GGUF_TYPES); tensors of other types stay in the model's dtype (logged).
The token embedding stays in the model's dtype (a lookup reads T rows, not the matrix). The engine's promise
becomes identity with plain decoding of the same quantized model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ConfigError
from .formats import BLOCK, GGUF_TYPES, QuantizedWeight, dequantize, from_gguf_blocks, quantize
from .linear import QuantizedLinear, fused_linear

log = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4", "gguf")


@dataclass
class QuantReport:
    """What quantize_model did, for logs and the roofline report."""
    quantization: str
    backend: str                          # "extension" | "torch"
    quantized: dict[str, str]             # parameter name -> format
    from_file: list[str]                  # names whose blocks came from the GGUF file unchanged
    kept: dict[str, str]                  # names left in the model's dtype -> why
    weight_bytes: int                     # bytes one forward reads for all linear weights


def check_quantization(quantization: str | None, field: str = "quantization") -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(field, f"must be one of {', '.join(QUANTIZATIONS)} (or omitted), got {quantization!r}")


def linear_names(model) -> list[str]:
    """The native model's linear weights, by parameter name."""
    names = []
    for i in range(model.args.num_hidden_layers):
        names += [f"layers.{i}.self_attn.qkv.weight", f"layers.{i}.self_attn.o_proj.weight",
                  f"layers.{i}.mlp.gate_up.weight", f"layers.{i}.mlp.down_proj.weight"]
    return names + ["lm_head.weight"]


def quantize_model(model, quantization: str, gguf_path: str | None = None, backend: str = "auto",
                   field: str = "quantization") -> QuantReport:
    """Replace `model`'s linear weights (native Llama family) in place; frees their fp copies."""
    check_quantization(quantization, field)
    if not hasattr(model, "quantized"):
        raise ConfigError(field, f"--quantization needs a natively supported model (llama, mistral, qwen2, "
                                 f"qwen3), not {type(model).__name__}")
    if quantization == "gguf" and gguf_path is None:
        raise ConfigError(field, "'gguf' keeps a GGUF file's own blocks: the model must be a .gguf file")
    params = dict(model.named_parameters(remove_duplicate=False))
    file_types: dict[str, str] = {}            # fused name -> the GGUF types of its parts (what gguf cannot take)
    from_file = _gguf_weights(model, gguf_path, file_types) if gguf_path else {}
    rep = QuantReport(quantization, "torch", {}, [], {}, 0)
    for name in linear_names(model):
        w = params[name]
        parts = from_file.get(name)
        if parts is not None and (quantization == "gguf" or {p.fmt for p in parts} == {quantization}):
            rep.from_file.append(name)
            lin = fused_linear(parts, backend)
            model.quantized[name] = lin
            rep.backend = lin.backend
            rep.quantized[name] = "/".join(dict.fromkeys(p.fmt for p in parts))
            rep.weight_bytes += lin.nbytes
            continue
        if quantization == "gguf":
            ft = file_types.get(name, "unknown")
            rep.kept[name] = (f"GGUF type {ft}: the int8 kernel takes {', '.join(GGUF_TYPES)}; it runs dequantized"
                              if any(t not in GGUF_TYPES for t in ft.split("/")) else
                              "its blocks did not match the loaded weight")
            continue
        if w.shape[1] % BLOCK:
            rep.kept[name] = f"input dimension {w.shape[1]} is not a multiple of {BLOCK}"
            continue
        qw = quantize(w.detach(), quantization)
        lin = QuantizedLinear(qw, backend)
        rep.backend = lin.backend
        model.quantized[name] = lin
        rep.quantized[name] = qw.fmt
        rep.weight_bytes += qw.nbytes
    for name in rep.kept:
        rep.weight_bytes += params[name].numel() * params[name].element_size()
    if rep.kept:
        name, why = next(iter(rep.kept.items()))
        log.warning("quantization %s: %d of %d linear weights stay in %s, e.g. %s (%s)", quantization, len(rep.kept),
                    len(rep.kept) + len(rep.quantized), params[name].dtype, name, why)
    _free_fp_weights(model, rep.quantized)
    model._fast = None
    model._one_call = False
    log.info("quantization %s: %d linear weights quantized (%d from the GGUF file as stored), %.1f MB read per "
             "forward, %s kernel", quantization, len(rep.quantized), len(rep.from_file), rep.weight_bytes / 1e6,
             rep.backend)
    return rep


def _free_fp_weights(model, names) -> None:
    """Drop the fp copies the quantized weights replace (the tied embedding stays: lookups need it)."""
    tied = model.lm_head.weight is model.embed_tokens.weight
    for name in names:
        if name == "lm_head.weight" and tied:
            continue
        mod = model.get_submodule(name.rsplit(".", 1)[0])
        mod.weight = nn.Parameter(torch.empty(0, dtype=mod.weight.dtype, device=mod.weight.device),
                                  requires_grad=False)


def _gguf_weights(model, path: str, types: dict[str, str] | None = None) -> dict[str, list[QuantizedWeight]]:
    """The GGUF file's tensors of the kernel's types as QuantizedWeights under the native model's (fused) names
    (the parts of a fused matrix in order: q, k, v share a matrix only when they share a format), checked
    against the weights the model already holds (dequantized by the loader): a layout we do not expect is
    requantized with a warning instead of silently computing on permuted rows."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    a = model.args
    out: dict[str, QuantizedWeight] = {}

    def get(n: str) -> QuantizedWeight | None:
        t = raw.get(n)
        if t is None or t.tensor_type.name not in GGUF_TYPES:
            return None
        K, N = (int(x) for x in t.shape[:2])
        return from_gguf_blocks(t.data, t.tensor_type.name, (N, K))

    def put(name: str, parts: list[QuantizedWeight | None], srcs: list[str]) -> None:
        if types is not None:
            types[name] = "/".join(dict.fromkeys(raw[n].tensor_type.name for n in srcs if n in raw))
        if any(p is None for p in parts):
            return
        have = model.get_parameter(name).detach().float()
        deq = torch.cat([dequantize(p) for p in parts])
        # the loader dequantized the same fp16 scales: they differ by at most a rounding of the scaled value
        tol = 4 * torch.finfo(torch.float32).eps * have.abs().amax().item()
        if deq.shape != have.shape or not torch.allclose(deq, have, rtol=0, atol=tol):
            log.warning("GGUF %s: the file's blocks do not match the loaded weight; requantizing it instead", name)
            return
        out[name] = parts

    for i in range(a.num_hidden_layers):
        b = f"blk.{i}."
        for name, srcs in ((f"layers.{i}.self_attn.qkv.weight", ["attn_q", "attn_k", "attn_v"]),
                           (f"layers.{i}.self_attn.o_proj.weight", ["attn_output"]),
                           (f"layers.{i}.mlp.gate_up.weight", ["ffn_gate", "ffn_up"]),
                           (f"layers.{i}.mlp.down_proj.weight", ["ffn_down"])):
            srcs = [f"{b}{n}.weight" for n in srcs]
            put(name, [get(n) for n in srcs], srcs)
    head = "output.weight" if "output.weight" in raw else "token_embd.weight"
    put("lm_head.weight", [get(head)], [head])
    return out

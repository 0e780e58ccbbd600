"""Floating-point tolerances derived from the arithmetic, not tuned on one machine.

The same logits computed with two batch shapes (a tree block vs a branch alone, a batch of rows vs one row) or
two kernels (leaplm vs transformers) differ by rounding only: BLAS and SDPA pick a summation order per shape and
per CPU (AVX2 vs AVX-512, Intel vs AMD), so a constant such as 1e-5 that holds on one machine fails on another.
A sum of n terms of magnitude m rounded at each addition is off by at most about n * eps * m (Higham's bound,
usually far from reached); a forward is a chain of such sums, so its bound is eps x (the reductions' length
along the chain) x (the magnitude of what is compared). Token ids are compared exactly, never with these.
"""
from __future__ import annotations

import torch


def eps(dtype: torch.dtype) -> float:
    """Unit roundoff of `dtype` (float32: 1.2e-7, bfloat16: 7.8e-3, float16: 9.8e-4)."""
    return torch.finfo(dtype).eps


def sum_tolerance(dtype: torch.dtype, length: int, magnitude: float = 1.0) -> float:
    """Absolute difference two summation orders of `length` terms of size up to `magnitude` may show."""
    return eps(dtype) * max(1, length) * magnitude


def forward_reduction_length(model) -> int:
    """The reductions one native decoder forward chains: per layer its widest matmul (hidden or intermediate),
    attention over at most the cache, and the residual additions; plus the final projection."""
    a = model.args
    per_layer = max(a.hidden_size, a.intermediate_size, a.num_attention_heads * a.head_dim)
    return a.num_hidden_layers * per_layer + a.hidden_size


def logits_tolerance(model, logits: torch.Tensor) -> float:
    """atol for comparing `model`'s logits across batch shapes or kernels, from its dtype, its reduction length
    and the logits' own magnitude."""
    magnitude = float(logits.detach().abs().max()) if logits.numel() else 1.0
    return sum_tolerance(logits.dtype, forward_reduction_length(model), max(1.0, magnitude))

"""Tolerances from dtype eps x reduction length (numerics.py): they cover what reordering a sum really does, grow
with the length and the dtype's eps, and stay far below what a real bug moves."""
from __future__ import annotations

import torch

from leaplm.numerics import logits_tolerance, sum_tolerance


def test_reordered_sums_stay_within_the_bound():
    g = torch.Generator().manual_seed(0)
    for n in (16, 256, 4096):
        x = torch.randn(n, generator=g)
        forward = torch.zeros(())
        for v in x:                              # left to right, one rounding per addition
            forward = forward + v
        backward = torch.zeros(())
        for v in x.flip(0):
            backward = backward + v
        assert abs(float(forward - backward)) <= sum_tolerance(torch.float32, n, float(x.abs().max()))


def test_tolerance_grows_with_eps_and_length():
    assert sum_tolerance(torch.float32, 64) < sum_tolerance(torch.float32, 4096)
    assert sum_tolerance(torch.float32, 64) < sum_tolerance(torch.float16, 64) < sum_tolerance(torch.bfloat16, 64)


def test_logits_tolerance_is_far_below_a_real_difference(tiny_llama):
    """Negative control: a one-token change of context moves the logits by orders of magnitude more."""
    model = tiny_llama.model
    a = model(torch.tensor([[1, 2, 3, 4]]), model.new_cache(1, 16))[0, -1]
    b = model(torch.tensor([[1, 2, 5, 4]]), model.new_cache(1, 16))[0, -1]
    assert (a - b).abs().max() > 100 * logits_tolerance(model, a)

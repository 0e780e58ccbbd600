"""A tiny model's norms and biases moved off their initial values, for parity tests."""
from __future__ import annotations

import torch


def perturb_(model, seed: int) -> None:
    """Norm weights to 1 + noise and every bias to noise (initialised as 1 and 0), so a swapped, dropped or
    misnamed norm or bias shows in the logits."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for module in model.modules():
            is_norm = "Norm" in type(module).__name__
            for pname, p in module.named_parameters(recurse=False):
                if is_norm and pname == "weight":
                    p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
                elif pname == "bias":
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))

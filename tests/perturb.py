"""Tiny models moved off their initial values: norms and biases for parity tests, every weight for a draft that
agrees with its target often."""
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


def write_noisy_copy(src: str, dst, noise: float, seed: int) -> str:
    """The checkpoint at src with every weight w replaced by w + noise * std(w) * N(0, 1): a different model that
    still agrees with src often."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(dst))
    AutoTokenizer.from_pretrained(src).save_pretrained(str(dst))
    return str(dst)

"""FastRMSNorm (the decoder's hot-path RMSNorm) must equal F.rms_norm bit for bit: greedy output of every
model depends on it, so the faster norm must not move a single bit of any model's logits."""
import pytest
import torch
import torch.nn.functional as F

from leaplm.models.llama import FastRMSNorm


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 8, 576), (2, 3, 512), (1, 12, 4, 64), (3, 5, 2048)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_fp32_equals_f_rms_norm_bit_for_bit(shape, eps):
    norm = FastRMSNorm(shape[-1], eps)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g) * 10.0 ** (seed % 7 - 3)        # tiny to large magnitudes
        w = torch.randn(shape[-1], generator=g)
        with torch.inference_mode():
            assert torch.equal(norm(x, w), F.rms_norm(x, (shape[-1],), w, eps)), seed


def test_other_dtypes_go_to_f_rms_norm():
    norm = FastRMSNorm(64, 1e-5)
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(64).bfloat16()
    assert torch.equal(norm(x, w), F.rms_norm(x, (64,), w, 1e-5))

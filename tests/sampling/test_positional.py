"""sampling/positional.py: the CPU's numpy hash gives the exponentials of the int64 torch path (any device) bit
for bit, so a seeded request's tokens do not depend on which path ran; both match SplitMix64 on Python integers."""
from __future__ import annotations

import math

import pytest
import torch

from leaplm.sampling import positional
from leaplm.sampling.positional import _uniforms_np, _uniforms_torch, exponentials, position_key, race


@pytest.mark.parametrize("seed", [0, 7, (1 << 64) - 1, 1 << 63])
@pytest.mark.parametrize("vocab", [1, 37, 4096, 49152])
def test_numpy_and_torch_paths_agree_bit_for_bit(seed, vocab):
    positions = [0, 1, 5, 10**6, 2**40]
    a = _uniforms_np(seed, positions, vocab, None)
    b = _uniforms_torch(seed, positions, vocab, "cpu", None).numpy()
    assert a.dtype == b.dtype and (a == b).all()
    ids = torch.tensor([vocab - 1, 0, vocab // 2], dtype=torch.long)
    assert (_uniforms_np(seed, positions, vocab, ids) == _uniforms_torch(seed, positions, vocab, "cpu", ids).numpy()).all()
    assert (_uniforms_np(seed, positions, vocab, ids) == a[:, ids.numpy()]).all()


def test_uniforms_are_splitmix64_on_python_integers():
    seed, pos = 12345, 77
    e = exponentials(seed, [pos], 300)
    for tok in (0, 1, 299):
        h = positional._mix64((position_key(seed, pos) + tok * positional._GOLDEN) & positional.MASK64)
        u = ((h >> 11) + 0.5) / (1 << 53)
        # the same double u; torch's and libm's logs are each within 1 ulp of the true value: 2 ulps apart at most
        assert math.isclose(float(e[0, tok]), -math.log(u), rel_tol=2 * 2.0**-52)


def test_race_over_a_large_vocabulary_is_the_argmax_of_p_over_e():
    p = torch.randn(3, 49152).softmax(-1)
    got = race(p, 9, [4, 5, 6])
    want = (p.double() / -torch.log(_uniforms_torch(9, [4, 5, 6], 49152, "cpu", None))).argmax(-1)
    assert got.tolist() == want.tolist()

"""sampling/categorical.py: one draw per row by inverting the float64 CDF, against the exact distribution (the
engine's Monte Carlo bound, tests/engine/mc_bounds.py: a correct sampler fails by chance less than once in a
million runs), with a deliberately broken sampler as the negative control; tokens of probability 0 are never
drawn, including where u * total rounds up to the total."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from leaplm.sampling.categorical import sample_categorical

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from mc_bounds import tv_and_bound  # noqa: E402

N = 20000


def exact_probs(seed: int = 0, V: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(V, generator=g) * 1.5).softmax(-1)
    p[[3, 17, 31]] = 0.0                                  # holes: never drawn
    return p / p.sum()


def empirical(draws: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(draws, minlength=V).double() / draws.numel()


def test_draws_follow_the_distribution_in_batched_rows():
    p = exact_probs()
    rows = torch.stack([p, p.flip(0)])                    # [2, V]: two rows drawn together, each its own
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([sample_categorical(rows * 3.0, g) for _ in range(N)])   # unnormalised weights
    for r in range(2):
        tv, bound = tv_and_bound(empirical(draws[:, r], p.numel()), rows[r].double(), N)
        assert tv < bound, (r, tv, bound)
    assert not bool(torch.isin(draws[:, 0], torch.tensor([3, 17, 31])).any())


def test_the_bound_catches_a_sampler_that_forgets_the_total():
    """Negative control: the same check fails a search for u instead of u * total over unnormalised weights (the
    draws then stay in the first third of the mass)."""
    p = exact_probs()
    g = torch.Generator().manual_seed(1)

    def broken(w: torch.Tensor) -> torch.Tensor:
        cdf = w.double().cumsum(-1)
        u = torch.rand((1,), generator=g, dtype=torch.float64)
        return torch.searchsorted(cdf, u, right=True)

    draws = torch.cat([broken(p * 3.0) for _ in range(N)])
    tv, bound = tv_and_bound(empirical(draws, p.numel()), p.double(), N)
    assert tv > bound, (tv, bound)


def test_a_uniform_that_rounds_up_to_the_total_draws_the_last_positive_token(monkeypatch):
    p = torch.tensor([0.25, 0.75, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(a[0], dtype=torch.float64))   # u = 1
    assert int(sample_categorical(p)) == 1
    assert sample_categorical(torch.stack([p, p.flip(0)])).tolist() == [1, 3]


def test_no_mass_is_refused():
    with pytest.raises(ValueError, match="no mass"):
        sample_categorical(torch.zeros(5))

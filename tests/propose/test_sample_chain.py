"""A chain proposer's sampled draft token (ProposeContext.sample_chain): the race's coupled sample when the race
verifies, a draw from q by the request's generator when rejection sampling does. Seeded, no model."""
from __future__ import annotations

import torch

from leaplm.config import SamplingParams
from leaplm.propose.base import ProposeContext
from leaplm.sampling import LogitsProcessor, make_generator
from leaplm.sampling.positional import ranked

Q = torch.tensor([0.5, 0.3, 0.15, 0.05])
DRAWS = 4000


def ctx(wants_q: bool, seed: int = 7) -> ProposeContext:
    params = SamplingParams(temperature=1.0, seed=seed)
    return ProposeContext(list(range(10)), 4, params, LogitsProcessor(params), make_generator(seed), None,
                          seed=seed, wants_q=wants_q)


def total_variation(counts: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - q).abs().sum())


def test_under_the_race_the_draft_token_is_the_coupled_sample():
    c = ctx(wants_q=False)
    for offset in range(6):
        assert c.sample_chain(Q, offset) == ranked(Q, 7, 10 + offset, 1)[0]


def test_under_rejection_sampling_draws_follow_q():
    """DRAWS draws at one position from the generator: their empirical distribution is within 0.04 of q in total
    variation (the expected TV of 4000 draws over 4 tokens is about 0.01; 0.04 is beyond four standard deviations).
    The race at one position gives one token whatever the draws (TV 0.5 from this q): the control that the draws
    do not come from it. A draw from the wrong q fails the same bound."""
    c = ctx(wants_q=True)
    counts = torch.zeros(4)
    for _ in range(DRAWS):
        counts[c.sample_chain(Q, 0)] += 1
    assert total_variation(counts, Q) < 0.04, counts
    race = ctx(wants_q=False)
    fixed = torch.zeros(4)
    for _ in range(200):
        fixed[race.sample_chain(Q, 0)] += 1
    assert total_variation(fixed, Q) >= 0.5 - 1e-9
    wrong = torch.tensor([0.25, 0.25, 0.25, 0.25])
    other = torch.zeros(4)
    for _ in range(DRAWS):
        other[c.sample_chain(wrong, 0)] += 1
    assert total_variation(other, Q) > 0.04

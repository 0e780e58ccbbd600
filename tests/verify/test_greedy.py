"""Greedy verification (verify/greedy.py) against a readable reference loop."""
from __future__ import annotations

import random

import pytest
import torch

from leaplm.verify import verify_greedy


def reference(draft: list[int], argmax: list[int]) -> tuple[list[int], int]:
    out = []
    for d, t in zip(draft, argmax):
        if d != t:
            break
        out.append(d)
    n = len(out)
    return out + [argmax[n]], n


def test_all_accepted_adds_the_bonus():
    res = verify_greedy(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 6, 9]))
    assert res.tokens == [4, 5, 6, 9] and res.accepted == 3 and res.path is None


def test_first_mismatch_emits_the_target_token_and_stops():
    res = verify_greedy(torch.tensor([4, 7, 6]), torch.tensor([4, 5, 6, 9]))
    assert res.tokens == [4, 5] and res.accepted == 1          # a later agreement (6) does not count


def test_rejected_at_once_and_no_drafts():
    assert verify_greedy(torch.tensor([1]), torch.tensor([2, 3])).tokens == [2]
    res = verify_greedy(torch.empty(0, dtype=torch.long), torch.tensor([8]))
    assert res.tokens == [8] and res.accepted == 0


@pytest.mark.parametrize("seed", range(5))
def test_matches_reference_on_random_chains(seed):
    rng = random.Random(seed)
    for _ in range(200):
        K = rng.randint(0, 8)
        argmax = [rng.randrange(3) for _ in range(K + 1)]          # 3 symbols: long agreements are common
        draft = [rng.randrange(3) for _ in range(K)]
        res = verify_greedy(torch.tensor(draft, dtype=torch.long), torch.tensor(argmax))
        assert (res.tokens, res.accepted) == reference(draft, argmax)

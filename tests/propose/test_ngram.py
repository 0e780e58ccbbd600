"""The incremental n-gram index (propose/ngram_index.py) against brute force, and the ngram proposer."""
from __future__ import annotations

import random

import pytest
import torch

from leaplm.config import SamplingParams
from leaplm.propose.base import ProposeContext
from leaplm.propose.ngram import NgramProposer
from leaplm.propose.ngram_index import NgramIndex
from leaplm.sampling import LogitsProcessor


def ctx(tokens: list[int], k: int) -> ProposeContext:
    params = SamplingParams(temperature=0)
    return ProposeContext(tokens, k, params, LogitsProcessor(params), None, None)


def brute_force_followers(tokens: list[int], key: tuple) -> list[int]:
    """Positions i < len(tokens) whose preceding n tokens are `key`, oldest first (slow reference)."""
    n = len(key)
    return [i for i in range(n, len(tokens)) if tuple(tokens[i - n: i]) == key]


@pytest.mark.parametrize("seed", range(5))
def test_index_grown_in_chunks_equals_brute_force(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(120)]
    index = NgramIndex(1, 3, keep=5)
    doc = index.new_doc()
    at = 0
    while at < len(tokens):                      # committed in steps of 1..6 tokens, as the engine does
        step = rng.randint(1, 6)
        index.extend(doc, tokens[at: at + step])
        at += step
    for n in (1, 2, 3):
        for key in {tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)}:
            got = [occ & ((1 << 40) - 1) for occ in index.lookup(key)]
            assert got == brute_force_followers(tokens, key)[-5:]
    assert index.size == len(tokens)


def test_continuation_context_match_and_live_period():
    index = NgramIndex(1, 2, keep=4)
    doc = index.new_doc()
    index.extend(doc, [9, 1, 2, 3, 1, 2])
    occ = index.lookup((1, 2))[-1]                           # the follower of the first "1 2" is 3, at 3
    assert index.continuation(occ, 2) == [3, 1]
    assert index.continuation(occ, 6) == [3, 1, 2]           # a finished document simply ends
    assert index.continuation(occ, 6, live=True) == [3, 1, 2, 3, 1, 2]   # a live context repeats its loop
    assert index.context_match(occ, [9, 1, 2, 3, 1, 2], 2, limit=10) == 2   # "9 1 2" vs "3 1 2": 2 tokens
    assert index.context_match(occ, [7, 9, 1, 2], 2, limit=10) == 3          # back to the document start
    assert index.context_match(occ, [7, 9, 1, 2], 2, limit=2) == 2


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    p = NgramProposer(1, 3, torch.device("cpu"))
    tokens = [5, 1, 2, 3, 8, 1, 2, 4, 6, 2, 1, 2]
    assert p.propose(ctx(tokens, 3)).tokens.tolist() == [4, 6, 2]     # "1 2" most recently followed by 4
    tokens = [5, 1, 2, 3, 8, 1, 2, 4, 6, 5, 1, 2]
    assert p.propose(ctx(tokens, 3)).tokens.tolist() == [3, 8, 1]     # the 3-gram "5 1 2" wins over "1 2"


def test_ngram_with_no_match_proposes_nothing_and_indexes_incrementally():
    p = NgramProposer(2, 3, torch.device("cpu"))
    tokens = [1, 2, 3, 4]
    prop = p.propose(ctx(tokens, 4))
    assert prop.k == 0 and prop.q is None and prop.parents is None
    tokens += [5, 1, 2]                             # committed: the index catches up with these only
    assert p.propose(ctx(tokens, 4)).tokens.tolist() == [3, 4, 5, 1]
    assert p.index.size == len(tokens)


def test_ngram_in_a_loop_proposes_k_tokens():
    p = NgramProposer(1, 4, torch.device("cpu"))
    assert p.propose(ctx([7, 1, 2, 3, 1, 2], 5)).tokens.tolist() == [3, 1, 2, 3, 1]

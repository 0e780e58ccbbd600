"""Lookahead: the window's mask and positions against the model, the pool, the guess trie, the Jacobi update."""
from __future__ import annotations

import torch

from leaplm.cache.tree import tree_layout
from leaplm.config import SamplingParams
from leaplm.numerics import logits_tolerance
from leaplm.propose.base import ProposeContext
from leaplm.propose.lookahead import LookaheadProposer, window_shape
from leaplm.sampling import LogitsProcessor
from leaplm.verify import VerifyResult


def ctx(tokens: list[int], k: int) -> ProposeContext:
    params = SamplingParams(temperature=0)
    return ProposeContext(tokens, k, params, LogitsProcessor(params), None, None)


def window_paths(levels: list[list[int]]) -> list[list[int]]:
    """The sequence each window token (l, j) ends, after the root: level 0 up to column j, then column j's
    levels 1..l (slow reference)."""
    W = len(levels[0])
    return [levels[0][: j + 1] + [levels[m][j] for m in range(1, l + 1)] for l in range(len(levels)) for j in range(W)]


def test_each_window_token_sees_exactly_its_path(tiny_llama):
    model = tiny_llama.model
    context, nodes, parents = [3, 1, 4, 1, 5], [9, 2], [-1, 0]
    levels = [[7, 8, 6], [2, 3, 4], [11, 12, 13]]
    mask, depths = window_shape(len(levels), 3)
    lay = tree_layout(parents, mask, depths)
    cache = model.new_cache(1, 64)
    model(torch.tensor([context[:-1]]), cache)
    cache.advance(len(context) - 1)
    flat = [t for level in levels for t in level]
    logits = model(torch.tensor([[context[-1]] + nodes + flat]), cache, tree_mask=lay.mask,
                   position_offsets=lay.depths)[0]
    for a, path in enumerate(window_paths(levels)):
        alone = model(torch.tensor([context + path]), model.new_cache(1, 64))[0, -1]
        torch.testing.assert_close(logits[1 + len(nodes) + a], alone, atol=logits_tolerance(model, alone), rtol=0)
        assert int(depths[a]) == len(path)


def test_guesses_from_the_context_merge_into_a_trie():
    p = LookaheadProposer(window=2, ngram_size=3, guess_set=3, max_len=100, device=torch.device("cpu"))
    tokens = [5, 1, 2, 5, 1, 3, 5, 2, 2, 5]
    prop = p.propose(ctx(tokens, 8))
    # n-grams after 5, newest first: (2, 2), (1, 3), (1, 2) -> trie 2-2, 1-3, 1-2 sharing the 1
    assert prop.tokens.tolist() == [2, 2, 1, 3, 2] and prop.parents == [-1, 0, -1, 2, 2]
    assert p.propose(ctx(tokens, 3)).tokens.tolist() == [2, 2, 1]     # the node budget K
    assert prop.q is None and prop.extra is not None and prop.extra.tokens.numel() == 2   # one level so far


def test_window_grows_then_harvests_and_shifts():
    W = 2
    p = LookaheadProposer(window=W, ngram_size=3, guess_set=4, max_len=100, device=torch.device("cpu"))
    tokens = [1, 2, 3]
    p.propose(ctx(tokens, 4))
    assert p.levels == [[2, 3]]

    def feed(new):                                # extra logits whose last level's argmax is `new`
        proposal = p.propose(ctx(tokens, 4))
        L = len(p.levels)
        logits = torch.zeros(L * W, 20)
        logits[torch.arange((L - 1) * W, L * W), torch.tensor(new)] = 1.0
        p.observe(proposal, VerifyResult([0], 0, []), logits)

    feed([7, 8])
    assert p.levels == [[2, 3], [7, 8]]           # warm-up: a level per step, nothing harvested
    assert 2 not in p.pool or (7, 9) not in p.pool[2]
    feed([9, 10])
    assert p.levels == [[7, 8], [9, 10]]          # full: the oldest level drops out
    assert (7, 9) in p.pool[2] and (8, 10) in p.pool[3]   # column n-grams (level 0, level 1, new)


def test_no_window_when_the_cache_has_no_room():
    p = LookaheadProposer(window=4, ngram_size=2, guess_set=2, max_len=12, device=torch.device("cpu"))
    assert p.propose(ctx(list(range(10)), 1)).extra is None
    p = LookaheadProposer(window=4, ngram_size=2, guess_set=2, max_len=16, device=torch.device("cpu"))
    assert p.propose(ctx(list(range(10)), 1)).extra is not None

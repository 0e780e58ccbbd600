"""Tree masks and positions (cache/tree.py), checked against ancestry walks and against the model itself: every
tree node's logits equal those of its branch run alone, and a cache compacted along a path equals a fresh one."""
from __future__ import annotations

import pytest
import torch

from leaplm.cache.tree import children, node_depths, tree_layout
from leaplm.numerics import logits_tolerance

SHAPES = [
    [],
    [-1],
    [-1, 0, 1, 2],                 # chain
    [-1, -1, -1],                  # star
    [-1, -1, 0, 0, 1, 1],          # binary
    [-1, 0, 0, -1, 3, 1, 5, 5],    # mixed
]


def ancestors_or_self(parents: list[int], row: int) -> set[int]:
    """Block rows on the path root..row (slow reference)."""
    out = {0, row}
    while row > 0:
        row = parents[row - 1] + 1
        out.add(row)
    return out


@pytest.mark.parametrize("parents", SHAPES)
def test_mask_is_the_ancestor_relation_and_depths_the_path_lengths(parents):
    lay = tree_layout(parents)
    T = len(parents) + 1
    assert lay.mask.shape == (T, T) and lay.n_tree == T
    for r in range(T):
        anc = ancestors_or_self(parents, r)
        assert lay.mask[r].tolist() == [c in anc for c in range(T)]
        assert int(lay.depths[r]) == len(anc) - 1
    assert lay.depths.tolist() == node_depths(parents)


def test_children_lists_rows():
    assert children([-1, 0, 0, -1, 3]) == [[0, 3], [1, 2], [], [], [4], []]


@pytest.mark.parametrize("parents", [[0], [-2], [-1, 1], [-1, 0, 3]])
def test_parents_out_of_order_are_refused(parents):
    with pytest.raises(ValueError, match="topologically"):
        tree_layout(parents)


def test_extra_tokens_see_the_root_and_their_mask_and_no_node_sees_them():
    parents = [-1, 0]
    extra_mask = torch.tensor([[True, False], [True, True]])
    lay = tree_layout(parents, extra_mask, torch.tensor([1, 2]))
    assert lay.n_tree == 3 and lay.mask.shape == (5, 5)
    assert not lay.mask[:3, 3:].any()                          # the tree never sees the window
    assert lay.mask[3:, 0].all() and not lay.mask[3:, 1:3].any()
    assert torch.equal(lay.mask[3:, 3:], extra_mask)
    assert lay.depths.tolist() == [0, 1, 2, 1, 2]


# --- against the model ------------------------------------------------------------------------------------------
def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] of `ids` from an empty cache: the reference every tree row is compared with."""
    cache = model.new_cache(1, 64)
    return model(torch.tensor([ids]), cache)[0]


def paths(parents, tokens):
    out = [[]]
    for i, p in enumerate(parents):
        out.append(out[p + 1] + [tokens[i]])
    return out


@pytest.mark.parametrize("parents", SHAPES[1:])
def test_each_node_logits_equal_its_branch_alone(tiny_llama, parents):
    model = tiny_llama.model
    g = torch.Generator().manual_seed(len(parents))
    context = torch.randint(0, model.vocab_size, (7,), generator=g).tolist()
    nodes = torch.randint(0, model.vocab_size, (len(parents),), generator=g).tolist()
    cache = model.new_cache(1, 64)
    model(torch.tensor([context[:-1]]), cache)
    cache.advance(len(context) - 1)
    lay = tree_layout(parents)
    logits = model(torch.tensor([[context[-1]] + nodes]), cache, tree_mask=lay.mask,
                   position_offsets=lay.depths)[0]                               # [K+1, V]
    for r, branch in enumerate(paths(parents, nodes)):
        alone = fresh_logits(model, context + branch)[-1]
        torch.testing.assert_close(logits[r], alone, atol=logits_tolerance(model, alone), rtol=0)


def test_extra_tokens_do_not_change_the_tree_and_follow_their_own_paths(tiny_llama):
    model = tiny_llama.model
    context, nodes, parents = [3, 1, 4, 1, 5], [9, 2, 6], [-1, 0, -1]
    extra, extra_mask = [7, 8, 5], torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    extra_depths = torch.tensor([1, 2, 1])
    cache = model.new_cache(1, 64)
    model(torch.tensor([context[:-1]]), cache)
    cache.advance(len(context) - 1)
    lay = tree_layout(parents, extra_mask, extra_depths)
    logits = model(torch.tensor([[context[-1]] + nodes + extra]), cache, tree_mask=lay.mask,
                   position_offsets=lay.depths)[0]                               # [1+K+A, V]
    for r, branch in enumerate(paths(parents, nodes)):
        ref = fresh_logits(model, context + branch)[-1]
        torch.testing.assert_close(logits[r], ref, atol=logits_tolerance(model, ref), rtol=0)
    for a, branch in enumerate([[7], [7, 8], [5]]):
        ref = fresh_logits(model, context + branch)[-1]
        torch.testing.assert_close(logits[4 + a], ref, atol=logits_tolerance(model, ref), rtol=0)


@pytest.mark.parametrize("path", [[], [0], [3, 4], [0, 2], [0, 1, 5, 7]])
def test_compact_along_a_path_equals_a_fresh_prefill(tiny_llama, path):
    model = tiny_llama.model
    parents = [-1, 0, 0, -1, 3, 1, 5, 5]          # paths used above are root-to-node chains of this tree
    nodes = [2, 7, 1, 8, 2, 8, 1, 8]
    context = [5, 3, 5, 9, 1]
    cache = model.new_cache(1, 64)
    model(torch.tensor([context[:-1]]), cache)
    cache.advance(len(context) - 1)
    lay = tree_layout(parents)
    model(torch.tensor([[context[-1]] + nodes]), cache, tree_mask=lay.mask, position_offsets=lay.depths)
    cache.compact([0] + [i + 1 for i in path])
    cache.advance(len(path) + 1)
    nxt = 6
    after = model(torch.tensor([[nxt]]), cache)[0, -1]
    kept = context + [nodes[i] for i in path]
    ref = fresh_logits(model, kept + [nxt])[-1]
    torch.testing.assert_close(after, ref, atol=logits_tolerance(model, ref), rtol=0)

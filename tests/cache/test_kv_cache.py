"""The cache rolls back by moving a length (cache/kv_cache.py): after any history of forwards, accepts,
rejects, truncations and tree compactions, the committed slots must equal a fresh prefill of the same tokens."""
from __future__ import annotations

import random

import pytest
import torch

from leaplm.cache.kv_cache import KVCache

MODELS = ["llama_tied", "mistral_sw", "qwen3_qknorm"]   # mistral: the window (8) is far shorter than the history
ATOL = 1e-5


def fresh_prefill(model, tokens: list[int]):
    cache = model.new_cache(1, 256)
    logits = model(torch.tensor([tokens]), cache)[0]                               # [n, V]
    cache.advance(len(tokens))
    return cache, logits


def assert_cache_equal(a: KVCache, b: KVCache, n: int) -> None:
    assert a.lengths[0] == b.lengths[0] == n
    for layer in range(len(a.k)):
        torch.testing.assert_close(a.k[layer][0, :, :n], b.k[layer][0, :, :n], atol=ATOL, rtol=0)
        torch.testing.assert_close(a.v[layer][0, :, :n], b.v[layer][0, :, :n], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_random_accepts_and_rejects_equal_fresh_prefill(name, seed, loaded):
    model = loaded(name).model
    V = model.vocab_size
    rng = random.Random(seed)
    committed = [rng.randrange(V) for _ in range(5)]
    cache = model.new_cache(1, 256)
    model(torch.tensor([committed]), cache)
    cache.advance(len(committed))
    kinds = set()
    for _ in range(30):
        block = [rng.randrange(V) for _ in range(rng.randint(1, 6))]               # [last token, drafts...]
        model(torch.tensor([block]), cache)
        keep = rng.randint(0, len(block))                                         # 0 = all rejected
        kinds.add("all" if keep == len(block) else "none" if keep == 0 else "some")
        cache.advance(keep)
        committed += block[:keep]
        if rng.random() < 0.2:                                                    # a draft cache's deeper rollback
            back = rng.randint(0, min(3, len(committed) - 1))
            cache.truncate(len(committed) - back)
            committed = committed[: len(committed) - back]
    assert kinds == {"all", "none", "some"}
    ref, ref_logits = fresh_prefill(model, committed)
    assert_cache_equal(cache, ref, len(committed))
    # and the next forward reads only committed slots: same logits as after the fresh prefill
    nxt = torch.tensor([[3, 1, 4]])
    torch.testing.assert_close(model(nxt, cache), model(nxt, ref), atol=ATOL, rtol=0)


def test_fallback_cache_rolls_back_like_a_fresh_prefill(loaded):
    """The fallback keeps a transformers DynamicCache and crops it lazily; logits after a random history of
    accepts and rejects equal those after a fresh prefill."""
    model = loaded("gpt2").model
    rng = random.Random(0)
    committed = [rng.randrange(model.vocab_size) for _ in range(5)]
    cache = model.new_cache()
    model(torch.tensor([committed]), cache)
    cache.advance(len(committed))
    for _ in range(15):
        block = [rng.randrange(model.vocab_size) for _ in range(rng.randint(1, 5))]
        model(torch.tensor([block]), cache)
        keep = rng.randint(0, len(block))
        cache.advance(keep)
        committed += block[:keep]
    ref = model.new_cache()
    model(torch.tensor([committed]), ref)
    ref.advance(len(committed))
    nxt = torch.tensor([[3, 1, 4]])
    torch.testing.assert_close(model(nxt, cache), model(nxt, ref), atol=ATOL, rtol=0)


# --- trees: compact() makes a root-to-leaf path contiguous ------------------------------------------------------
def tree_inputs(parents: list[int]):
    """parents[i] < i (-1 for the root, node 0) -> (tree_mask [T, T] bool: i sees its ancestors and itself,
    position_offsets [T]: depth)."""
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    depth = [0] * T
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask, torch.tensor(depth)


def random_tree(rng: random.Random, T: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, T)]


def path_to(parents: list[int], leaf: int) -> list[int]:
    path = [leaf]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("name", MODELS)
def test_compacted_tree_path_equals_fresh_prefill(name, seed, loaded):
    model = loaded(name).model
    V = model.vocab_size
    rng = random.Random(seed)
    committed = [rng.randrange(V) for _ in range(12)]                               # longer than the window
    cache = model.new_cache(1, 256)
    model(torch.tensor([committed[:-1]]), cache)
    cache.advance(len(committed) - 1)
    parents = random_tree(rng, 10)
    nodes = [committed[-1]] + [rng.randrange(V) for _ in range(9)]                 # node 0 = last committed token
    mask, offsets = tree_inputs(parents)
    logits = model(torch.tensor([nodes]), cache, tree_mask=mask, position_offsets=offsets)[0]   # [T, V]
    leaf = max(range(len(parents)), key=lambda i: (offsets[i], rng.random()))      # a deepest node
    path = path_to(parents, leaf)
    assert path != list(range(len(path)))                                          # compact really moves slots
    path_tokens = [nodes[i] for i in path]
    ref, ref_logits = fresh_prefill(model, committed[:-1] + path_tokens)
    # each path node's logits are those of the plain chain (tree attention sees exactly its ancestors)
    torch.testing.assert_close(logits[path], ref_logits[len(committed) - 1 :], atol=ATOL, rtol=0)
    cache.compact(path)
    cache.advance(len(path))
    assert_cache_equal(cache, ref, len(committed) - 1 + len(path))


def test_compact_moves_only_the_path_slots():
    cache = KVCache(n_layers=2, batch_size=1, n_kv_heads=1, head_dim=1, max_len=16)
    for layer in range(2):
        cache.k[layer][0, 0, :, 0] = torch.arange(16.0)
        cache.v[layer][0, 0, :, 0] = -torch.arange(16.0)
    cache.lengths[0] = 4
    cache.compact([0, 2, 5, 6])                         # slots 4, 6, 9, 10 -> 4, 5, 6, 7
    assert cache.lengths[0] == 4                        # compact does not advance
    for layer in range(2):
        assert cache.k[layer][0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 6, 9, 10]
        assert cache.v[layer][0, 0, :8, 0].tolist() == [0, -1, -2, -3, -4, -6, -9, -10]
    cache.compact([0, 1, 2])                            # already contiguous: nothing moves
    assert cache.k[0][0, 0, :8, 0].tolist() == [0, 1, 2, 3, 4, 6, 9, 10]


def test_truncate_and_room_are_checked():
    cache = KVCache(n_layers=1, batch_size=1, n_kv_heads=1, head_dim=2, max_len=8)
    cache.advance(5)
    with pytest.raises(ValueError):
        cache.truncate(6)                               # cannot roll forward
    with pytest.raises(ValueError):
        cache.check_room(4)                             # 5 + 4 > 8
    cache.check_room(3)
    cache.truncate(2)
    assert cache.lengths == [2]


def test_rows_of_different_lengths_match_single_rows(loaded):
    """Batched rows (the server's layout): each row attends to its own committed slots only."""
    model = loaded("mistral_sw").model
    a, b = list(range(3, 20)), list(range(40, 49))
    batch = model.new_cache(2, 256)
    for row, toks in enumerate((a, b)):
        single = model.new_cache(1, 256)
        model(torch.tensor([toks]), single)
        single.advance(len(toks))
        for layer in range(len(single.k)):
            batch.k[layer][row, :, : len(toks)] = single.k[layer][0, :, : len(toks)]
            batch.v[layer][row, :, : len(toks)] = single.v[layer][0, :, : len(toks)]
        batch.lengths[row] = len(toks)
    nxt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = model(nxt, batch)                                                          # [2, 3, V]
    for row, toks in enumerate((a, b)):
        ref = model(torch.tensor([toks + nxt[row].tolist()]), model.new_cache(1, 256))[0, len(toks):]
        torch.testing.assert_close(out[row], ref, atol=ATOL, rtol=0)


# --- growth: storage follows the rows' lengths (CHUNK shrunk so a short history crosses many chunks) ----------
@pytest.mark.parametrize("name", ["llama_tied", "mistral_sw"])
def test_growing_cache_equals_fresh_prefill(name, loaded, monkeypatch):
    from leaplm.cache import kv_cache

    monkeypatch.setattr(kv_cache, "CHUNK", 4)
    test_random_accepts_and_rejects_equal_fresh_prefill(name, 3, loaded)
    test_compacted_tree_path_equals_fresh_prefill(name, 1, loaded)


def test_growth_is_in_chunks_and_shrinks_when_empty(loaded, monkeypatch):
    from leaplm.cache import kv_cache

    monkeypatch.setattr(kv_cache, "CHUNK", 4)
    model = loaded("llama_tied").model
    cache = model.new_cache(2, 200)
    assert cache.capacity == 4 and cache.nbytes == 2 * 4 * cache.bytes_per_token
    view = cache.row_view(1)                                 # a joining row's prefill grows the parent
    model(torch.tensor([list(range(9))]), view)
    cache.advance(9, 1)
    assert cache.capacity == 12                              # 9 slots, at least doubled, in whole chunks
    assert cache.nbytes == 2 * 12 * cache.bytes_per_token
    view = cache.row_view(1)
    ref = model(torch.tensor([list(range(9)) + [5]]), model.new_cache(1, 200))[0, -1]
    torch.testing.assert_close(model(torch.tensor([[5]]), view)[0, -1], ref, atol=ATOL, rtol=0)
    with pytest.raises(ValueError):
        cache.check_room(192, 2)                             # 9 + 192 > 200: the limit stays max_len
    cache.truncate(0, 1)                                     # every row empty: back to one chunk
    assert cache.capacity == 4 and cache.peak_nbytes == 2 * 12 * cache.bytes_per_token

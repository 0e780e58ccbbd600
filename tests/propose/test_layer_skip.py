"""Layer-skip self-speculation: the draft is the target on a subset of layers, drafted in the target's cache."""
from __future__ import annotations

import torch

from leaplm.config import SamplingParams
from leaplm.propose.base import ProposeContext
from leaplm.propose.layer_skip import LayerSkipProposer, SkipSearch, candidate_skip_sets
from leaplm.sampling import LogitsProcessor, make_generator
from leaplm.verify import VerifyResult
from leaplm.numerics import logits_tolerance


def prefilled(model, context):
    cache = model.new_cache(1, 64)
    model(torch.tensor([context[:-1]]), cache)
    cache.advance(len(context) - 1)
    return cache


def ctx(tokens, k, cache, temperature=0.0, seed=0) -> ProposeContext:
    params = SamplingParams(temperature=temperature)
    gen = make_generator(seed) if temperature > 0 else None
    return ProposeContext(tokens, k, params, LogitsProcessor(params), gen, None, cache,
                          wants_q=temperature > 0)                                  # as rejection sampling asks


def test_drafts_are_the_layer_subset_model_and_the_cache_length_is_restored(tiny_llama):
    model = tiny_llama.model
    context = [3, 1, 4, 1, 5, 9]
    cache = prefilled(model, context)
    search = SkipSearch(4, [[1, 2]])
    p = LayerSkipProposer(model, search, confidence=0.0)
    prop = p.propose(ctx(context, 4, cache))
    assert cache.lengths[0] == len(context) - 1
    # reference in a cache of its own: the committed context as the target wrote it (all layers), then the
    # subset model one token at a time over it
    ref = prefilled(model, context)
    seq = list(context)
    for _ in range(4):
        logits = model(torch.tensor([[seq[-1]]]), ref, layers=[0, 3])[0, -1]
        ref.advance(1)
        seq.append(int(logits.argmax()))
    assert prop.tokens.tolist() == seq[len(context):] and prop.q is None
    # the target's own committed entries were not disturbed: a full forward still matches a fresh one
    full = model(torch.tensor([[context[-1]]]), cache)[0, -1]
    fresh = model(torch.tensor([context]), model.new_cache(1, 64))[0, -1]
    torch.testing.assert_close(full, fresh, atol=logits_tolerance(model, fresh), rtol=0)


def test_sampling_returns_q_rows(tiny_llama):
    model = tiny_llama.model
    context = [2, 7, 1, 8]
    prop = LayerSkipProposer(model, SkipSearch(4, [[1]]), 0.0).propose(ctx(context, 3, prefilled(model, context),
                                                                               temperature=1.0))
    assert prop.q.shape == (3, model.vocab_size)
    torch.testing.assert_close(prop.q.sum(-1), torch.ones(3))
    assert bool((prop.q[torch.arange(3), prop.tokens] > 0).all())


def test_low_confidence_stops_drafting_after_the_first_token(tiny_llama):
    model = tiny_llama.model
    context = [2, 7, 1, 8]
    p = LayerSkipProposer(model, SkipSearch(4, [[1, 2]]), confidence=0.999999)
    assert p.propose(ctx(context, 5, prefilled(model, context))).k == 1


def test_candidate_sets_keep_the_first_and_last_layer():
    assert candidate_skip_sets(2) == []
    for n in (3, 4, 8, 12):
        sets = candidate_skip_sets(n)
        assert sets and all(0 not in s and n - 1 not in s for s in sets)
        assert len({tuple(s) for s in sets}) == len(sets)
    assert candidate_skip_sets(8)[0] == [1, 3, 5]


def test_search_tries_every_set_in_turn_then_keeps_the_best():
    search = SkipSearch(8, [[1, 3, 5], [2, 4, 6], [4, 6]])
    for _ in range(8 * 3):
        i = search.pick()
        search.record(i, passes=4, emitted=3 if i == 1 else 1)
    assert search.chosen == 1 and search.pick() == 1
    search.record(0, passes=4, emitted=5)             # once chosen, the figures stop moving
    assert search.trials[0].steps == 8


def test_observe_records_the_step(tiny_llama):
    model = tiny_llama.model
    context = [2, 7, 1, 8]
    search = SkipSearch(4, [[1], [2]])
    p = LayerSkipProposer(model, search, 0.0)
    prop = p.propose(ctx(context, 2, prefilled(model, context)))
    p.observe(prop, VerifyResult([prop.tokens.tolist()[0], 0], 1))
    assert [t.steps for t in search.trials] == [1, 0] and search.trials[0].emitted == 2

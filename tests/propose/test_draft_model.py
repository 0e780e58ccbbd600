"""The draft model's batched proposals: one forward per draft position for a whole group, the same drafts as each
row alone, and slots that stay dense as rows leave."""
from __future__ import annotations

import torch

from leaplm.config import SamplingParams
from leaplm.propose.base import ProposeContext
from leaplm.propose.draft_model import CATCHUP_IN_BATCH, DraftModelFactory
from leaplm.sampling import LogitsProcessor
from leaplm.verify import VerifyResult


class CountingModel:
    """The draft CausalLM, counting forwards and the rows they ran."""

    def __init__(self, model):
        self.inner = model
        self.calls: list[tuple[int, int]] = []          # (B, T) per forward

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, ids, cache, **kw):
        self.calls.append(tuple(ids.shape))
        return self.inner(ids, cache, **kw)


def contexts(prompts, k, params):
    proc = LogitsProcessor(params)
    # one generator per request, as the engine keeps (rejection sampling's drafts are drawn from it)
    return [ProposeContext(list(p), k, params, proc, None if params.greedy else torch.Generator().manual_seed(i),
                           None, None, None if params.greedy else 11 + i, wants_q=not params.greedy)
            for i, p in enumerate(prompts)]      # q: compared below


def tolerance(model, logits_len: int) -> float:
    # a row's logits may differ across batch shapes by reduction-order rounding: eps x reduction length
    return torch.finfo(torch.float32).eps * logits_len * 8


def test_a_group_drafts_in_one_forward_per_position_and_matches_each_row_alone(loaded):
    draft = loaded("llama_draft").model
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 2)]
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=1)):
        k = 4
        counting = CountingModel(draft)
        factory = DraftModelFactory(counting)
        group = factory.new_group(4, 128)
        props = [factory(128, group) for _ in prompts]
        batched = group.propose_rows(props, contexts(prompts, k, params))
        long_prefills = sum(1 for p in prompts if len(p) > CATCHUP_IN_BATCH)
        assert len(counting.calls) == long_prefills + k            # per position one forward over every row
        assert all(b == 3 for b, _ in counting.calls[long_prefills:])
        alone = [DraftModelFactory(draft)(128).propose(c) for c in contexts(prompts, k, params)]
        for a, b in zip(alone, batched):
            assert a.tokens.tolist() == b.tokens.tolist()
            if params.greedy:
                assert a.q is None and b.q is None
            else:
                assert torch.allclose(a.q, b.q, atol=tolerance(draft, draft.vocab_size), rtol=0)


def test_rows_with_different_k_and_catch_up_keep_their_caches_right(loaded):
    """Drafting twice with commits in between (different K per row, one row not drafting in the second step)
    gives the drafts of a fresh proposer over the same tokens."""
    draft = loaded("llama_draft").model
    params = SamplingParams(temperature=0)
    factory = DraftModelFactory(draft)
    group = factory.new_group(3, 128)
    prompts = [list(range(3, 10)), list(range(4, 8)), list(range(5, 16))]
    props = [factory(128, group) for _ in prompts]
    ctxs = contexts(prompts, 3, params)
    ctxs[1].k = 1
    first = group.propose_rows(props, ctxs)
    for p, prop, ctx, acc in zip(props, first, ctxs, (3, 0, 1)):
        p.observe(prop, VerifyResult(prop.tokens.tolist()[:acc] + [1], acc))
        ctx.tokens.extend(prop.tokens.tolist()[:acc] + [1])
    second = group.propose_rows([props[0], props[2]], [ctxs[0], ctxs[2]])   # row 1 does not draft
    for prop, ctx in zip(second, (ctxs[0], ctxs[2])):
        fresh = DraftModelFactory(draft)(128).propose(contexts([ctx.tokens], 3, params)[0])
        assert prop.tokens.tolist() == fresh.tokens.tolist()


def test_slots_stay_dense_when_a_row_leaves(loaded):
    draft = loaded("llama_draft").model
    factory = DraftModelFactory(draft)
    group = factory.new_group(3, 64)
    a, b, c = (factory(64, group) for _ in range(3))
    assert [a.slot, b.slot, c.slot] == [0, 1, 2]
    params = SamplingParams(temperature=0)
    ctxs = contexts([[3, 4, 5], [6, 7], [8, 9, 10, 11]], 2, params)
    before = group.propose_rows([c], [ctxs[2]])[0]
    c.observe(before, VerifyResult([before.tokens.tolist()[0], 1], 1))
    ctxs[2].tokens.extend([before.tokens.tolist()[0], 1])
    a.close()
    assert group.owners == [c, b] and (c.slot, b.slot, a.slot) == (0, 1, -1)
    after = group.propose_rows([c], [ctxs[2]])[0]         # its cache moved with it
    fresh = DraftModelFactory(draft)(64).propose(contexts([ctxs[2].tokens], 2, params)[0])
    assert after.tokens.tolist() == fresh.tokens.tolist()
    d = factory(64, group)
    assert d.slot == 2 and d.cached == 0


def test_guesses_past_a_prompt_feed_the_prompt_without_its_logits_and_match_the_full_guesses(loaded):
    """Teacher-forced guesses asked from index `first` on (a request's output after its prompt): the prompt is fed
    in a forward that keeps no logits, the guesses are the same as the full forward's rows from first - 1 on, and
    the draft's next proposal is the same either way."""
    draft = loaded("llama_draft").model
    tokens, first = list(range(3, 3 + 30)), 20
    full = DraftModelFactory(draft)(128)
    g_full = full.guesses(tokens)
    counting = CountingModel(draft)
    part = DraftModelFactory(counting)(128)
    g_part = part.guesses(tokens, first)
    assert g_full.start == 0 and g_part.start == first - 1
    assert g_part.logits.shape[0] == len(tokens) - first
    assert counting.calls == [(1, first - 1), (1, len(tokens) - first)]
    assert torch.allclose(g_part.logits, g_full.logits[first - 1:], atol=tolerance(draft, draft.vocab_size), rtol=0)
    assert full.cached == part.cached == len(tokens) - 1
    params = SamplingParams(temperature=0)
    a, b = (p.propose(contexts([tokens], 4, params)[0]) for p in (full, part))
    assert a.tokens.tolist() == b.tokens.tolist()

"""EAGLE drafts over the head's N rows (its draft vocabulary) propose exactly what drafting over the whole
vocabulary proposed: the slow reference below scatters the head's logits into [T, V] with -inf outside the
draft vocabulary, normalises and ranks over V and expands every tree level (the proposer before it drafted over
N rows and skipped levels that cannot place). Greedy and seeded sampling, chains and trees, with and without a
repetition penalty; token ids and tree shapes compare exactly, q within rounding."""
from __future__ import annotations

import random

import pytest
import torch

from leaplm import SamplingParams
from leaplm.heads.loader import load_head_for
from leaplm.numerics import sum_tolerance
from leaplm.propose.base import ProposeContext
from leaplm.propose.eagle import EagleProposer, TreeShape
from leaplm.propose.tree_select import Node, select_tree
from leaplm.sampling import LogitsProcessor, make_generator
from leaplm.sampling.positional import ranked


class FullVocabReference(EagleProposer):
    """The slow reference: q over all V tokens (0 outside the draft vocabulary), every level expanded."""

    def _full(self, feats: torch.Tensor) -> torch.Tensor:
        return self.head.to_vocab(self.head.logits(feats), float("-inf"))              # [T, V]

    def _dist(self, ctx, logits):                                                       # [T, V] -> [T, V]
        if ctx.generator is None:
            return torch.softmax(logits.float(), -1)
        pres = ctx.presence.unsqueeze(0).expand(logits.shape[0], -1) if ctx.presence is not None else None
        return ctx.processor.probs(logits, pres)

    def _best(self, ctx, q, offset, n):                                                 # q [V]
        if ctx.generator is None:
            return q.topk(min(n, q.numel())).indices.tolist()
        return ranked(q, ctx.seed, len(ctx.tokens) + offset, n)

    def _chain(self, ctx, feat, k):
        L = len(ctx.tokens)
        drafts, qs = [], []
        for i in range(k):
            logits = self._full(feat.unsqueeze(0))                                      # [1, V]
            if ctx.generator is None:
                pres = ctx.presence.unsqueeze(0) if ctx.presence is not None else None
                t = int(ctx.processor.greedy(logits, pres))
            else:
                q = self._dist(ctx, logits)
                t = self._best(ctx, q[0], i, 1)[0]
                qs.append(q[0])
            drafts.append(t)
            if i + 1 < k:
                pos = L - 1 + i
                feat = self.head.run(self.cache, pos, feat.unsqueeze(0), torch.tensor([t]), torch.tensor([pos]),
                                     None)[0]
        from leaplm.propose.base import Proposal

        return Proposal(torch.tensor(drafts), torch.stack(qs) if qs else None)

    def _tree(self, ctx, root, k):
        L = len(ctx.tokens)
        b = self.shape.branch
        pool, slot_of = [], {}
        q = self._dist(ctx, self._full(root.unsqueeze(0)))[0]                            # [V]
        for t in self._best(ctx, q, 0, b):
            pool.append(Node(t, -1, float(torch.log(q[t])), 1))
        frontier = list(range(len(pool)))
        feats_of = {-1: root}
        depth, base = 1, self.n_cached
        while depth < min(self.shape.depth, k) and frontier:
            n0, T = base + len(slot_of), len(frontier)
            feats = torch.stack([feats_of[pool[i].parent] for i in frontier])
            toks = torch.tensor([pool[i].token for i in frontier])
            mask = torch.zeros(T, n0 + T, dtype=torch.bool)
            mask[:, :base] = True
            for r, i in enumerate(frontier):
                a = pool[i].parent
                while a >= 0:
                    mask[r, slot_of[a]] = True
                    a = pool[a].parent
                mask[r, n0 + r] = True
            out = self.head.run(self.cache, n0, feats, toks, torch.full((T,), L - 2 + depth), mask)
            for r, i in enumerate(frontier):
                slot_of[i], feats_of[i] = n0 + r, out[r]
            qs = self._dist(ctx, self._full(out))                                        # [T, V]
            new = []
            for r, i in enumerate(frontier):
                for t in self._best(ctx, qs[r], depth, b):
                    pool.append(Node(t, i, pool[i].score + float(torch.log(qs[r, t])), depth + 1))
                    new.append(len(pool) - 1)
            frontier = sorted(new, key=lambda j: -pool[j].score)[:b]
            depth += 1
        return select_tree(pool, k)


PARAMS = {"greedy": dict(temperature=0), "greedy-penalty": dict(temperature=0, repetition_penalty=1.3),
          "sampled": dict(temperature=1.0), "processed": dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05,
                                                              repetition_penalty=1.3)}
SHAPES = [TreeShape(depth=6, branch=1), TreeShape(depth=3, branch=2), TreeShape(depth=6, branch=3),
          TreeShape(depth=2, branch=4)]


def _context(tokens, k, params, seed, V):
    sp = SamplingParams(**params, seed=None if params["temperature"] == 0 else seed)
    presence = None
    if sp.repetition_penalty != 1.0:
        presence = torch.zeros(V, dtype=torch.bool)
        presence[torch.tensor(tokens)] = True
    sampled = not sp.greedy
    return ProposeContext(tokens, k, sp, LogitsProcessor(sp), make_generator(seed) if sampled else None, presence,
                          seed=seed if sampled else None, wants_q=sampled)      # q checked against the reference


@pytest.mark.parametrize("which", ["reduced", "reduced-random", "head", "random"])
@pytest.mark.parametrize("params", list(PARAMS))
def test_rows_propose_what_the_full_vocabulary_proposed(eagle16, which, params):
    target = eagle16["target"]
    head = load_head_for(eagle16[which], target)
    V, hid = head.embed.shape
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    runs = {"fast": 0, "ref": 0}
    trees = 0
    for trial in range(24):
        shape = SHAPES[trial % len(SHAPES)]
        L = rng.randrange(2, 12)
        tokens = [rng.randrange(V) for _ in range(L)]
        feats = torch.randn(L - 1, hid, generator=gen) * 2                             # [L-1, hid]
        k = rng.choice([1, 3, 5, 8, 12])
        fast, ref = EagleProposer(head, 64, shape), FullVocabReference(head, 64, shape)
        for name, prop in (("fast", fast), ("ref", ref)):
            prop.observe_hidden(0, feats)
            run = prop.head.run

            def counted(*a, _name=name, _run=run):
                runs[_name] += 1
                return _run(*a)
            prop.head = type(head)(head.net, head.embed, head.lm_head, head.vocab_ids)
            prop.head.run = counted
        a = fast.propose(_context(tokens, k, PARAMS[params], trial, V))
        b = ref.propose(_context(tokens, k, PARAMS[params], trial, V))
        assert a.tokens.tolist() == b.tokens.tolist(), (trial, shape, k)
        assert a.parents == b.parents, (trial, shape, k)
        trees += a.parents is not None
        assert (a.q is None) == (b.q is None)
        if a.q is not None:
            assert a.q.shape == (a.k, V)
            torch.testing.assert_close(a.q, b.q, rtol=0, atol=sum_tolerance(torch.float32, V))
            if head.vocab_ids is not None:              # q = 0 outside the draft vocabulary, sums to 1
                outside = torch.ones(V, dtype=torch.bool)
                outside[head.vocab_ids] = False
                assert not a.q[:, outside].any()
                torch.testing.assert_close(a.q.sum(-1), torch.ones(a.k), rtol=0, atol=sum_tolerance(torch.float32, V))
    assert trees > 0
    assert runs["fast"] < runs["ref"]                   # levels that could not place were skipped

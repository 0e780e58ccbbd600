"""EAGLE through the engine's one step: greedy output equals plain decoding for chains and trees of many shapes
(an empty proposal and a single node included), with a trained head and a random (miscalibrated) one; sampled
output follows the target's distribution (Monte Carlo, the bound of tests/engine/mc_bounds.py) in batches mixing
eagle rows with draft and plain rows, and the negative control (a verifier accepting every draft) fails it."""
from __future__ import annotations

import functools
import sys

import pytest
import torch

from leaplm import Engine, SamplingParams
from leaplm.propose import eagle as eagle_mod
from leaplm.propose.eagle import TreeShape
from leaplm.propose.tree_select import Node, select_tree

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "engine"))
from mc_bounds import tv_and_bound  # noqa: E402
from test_batch_distribution import N, sample_in_batches  # noqa: E402
from test_lossless_sampling import PLAIN, PROCESSED, always_accept, exact_positions_2_3  # noqa: E402

PROMPTS = [[1, 2, 3], [5], [7, 3, 9, 3, 7, 1, 2, 2, 4, 11, 12]]
SHAPES = {"chain": TreeShape(depth=8, branch=1), "narrow": TreeShape(depth=3, branch=2),
          "wide": TreeShape(depth=6, branch=4), "flat": TreeShape(depth=1, branch=5)}


def greedy(n: int = 40, penalty: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, repetition_penalty=penalty)


@pytest.fixture
def shape(request, monkeypatch):
    monkeypatch.setattr(eagle_mod, "TreeShape", lambda: SHAPES[request.param])
    return request.param


@pytest.mark.parametrize("shape,k", [("chain", 3), ("narrow", 3), ("wide", 10), ("flat", 5), ("wide", 1)],
                         indirect=["shape"])
@pytest.mark.parametrize("which", ["head", "random", "reduced", "reduced-random"])
def test_greedy_equals_none(eagle16, shape, k, which):
    target = eagle16["target"]
    eng = Engine(target, method="eagle", k=k, head=eagle16[which], adaptive_k=False)
    drafted = accepted = trees = 0
    for prompt in PROMPTS:
        for penalty in (1.0, 1.4):
            want = Engine(target, method="none").generate(prompt, greedy(penalty=penalty)).token_ids
            out = eng.generate(prompt, greedy(penalty=penalty))
            assert out.token_ids == want, (prompt, penalty)
            drafted += out.stats.draft_tokens
            accepted += out.stats.accepted_tokens
    assert drafted > 0
    if which in ("head", "reduced"):         # the trained heads' drafts are taken, not only proposed
        assert accepted > 0


def test_adaptive_k_and_end_of_context(eagle16):
    """The K policy may choose 0 (nothing proposed) or any node budget; the context's end leaves no room."""
    target = eagle16["target"]
    for max_len in (None, 30):
        eng = Engine(target, method="eagle", k=6, head=eagle16["head"], max_model_len=max_len)
        for prompt in PROMPTS:
            n = max_len - len(prompt) if max_len else 40     # up to the last position
            want = Engine(target, method="none", max_model_len=max_len).generate(prompt, greedy(n)).token_ids
            assert eng.generate(prompt, greedy(n)).token_ids == want


def test_select_keeps_a_tree_and_sends_chains_as_chains():
    pool = [Node(4, -1, -0.1, 1), Node(5, -1, -2.0, 1), Node(6, 0, -0.3, 2), Node(7, 0, -0.2, 2),
            Node(8, 3, -0.25, 3), Node(9, 1, -2.1, 2)]
    p = select_tree(pool, 4)                      # best 4: nodes 0, 3, 4, 2 -> a tree (node 0 has two children)
    assert p.tokens.tolist() == [4, 6, 7, 8] and p.parents == [-1, 0, 0, 2]
    c = select_tree(pool, 3)                      # nodes 0, 3, 4: a chain
    assert c.tokens.tolist() == [4, 7, 8] and c.parents is None
    assert select_tree(pool, 0).k == 0
    # a child never precedes its parent, even when scores tie
    tie = [Node(1, -1, -0.5, 1), Node(2, 0, -0.5, 2), Node(3, -1, -0.5, 1)]
    t = select_tree(tie, 3)
    assert t.parents == [-1, -1, 0]


# --- sampling: the distribution through mixed batches --------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle8(tiny_vocab, tmp_path_factory):
    """Heads for the 8-token target of the Monte Carlo tests: trained (near) and random (miscalibrated)."""
    from head_helpers import random_head, train_tiny_eagle, write_word_corpus

    target = tiny_vocab["target"]
    d = tmp_path_factory.mktemp("eagle8")
    corpus = write_word_corpus(d / "c.jsonl", 8)
    train_tiny_eagle(target.path, corpus, d / "head")
    train_tiny_eagle(target.path, corpus, d / "reduced", draft_vocab=5)     # q = 0 on 3 of the 8 tokens
    return {"head": str(d / "head"), "random": random_head(target, d / "random"), "reduced": str(d / "reduced"),
            "reduced-random": random_head(target, d / "reduced-random", draft_vocab=5)}


KINDS = [("eagle", 4), ("none", None), ("draft", 2), ("eagle", 2), ("eagle", 6)]


@pytest.mark.parametrize("case", ["processed-trained-tree", "processed-random-tree", "plain-trained-chain",
                                  "processed-reduced-tree"])
def test_sampled_rows_follow_the_target(case, tiny_vocab, ref_probs, eagle8, monkeypatch):
    """reduced: the head drafts over 5 of the 8 tokens; the other 3 are reached only as recovered or bonus
    tokens, so a verifier that mishandled q = 0 would miss their probability."""
    params = PLAIN if case.startswith("plain") else PROCESSED       # processed: T = 0.8, top-k, top-p, ...
    head = eagle8[{"trained": "head", "random": "random", "reduced": "reduced"}[case.split("-")[1]]]
    monkeypatch.setattr(eagle_mod, "TreeShape", (lambda: TreeShape(4, 3)) if "tree" in case else
                        (lambda: TreeShape(8, 1)))
    exact = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**params), ref_probs)
    eng = Engine(tiny_vocab["target"], draft=tiny_vocab["near"], method="draft", k=4, head=head, adaptive_k=False)
    got = sample_in_batches(eng, params, kinds=KINDS)
    tv, bound = tv_and_bound(got, exact, N)
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f} ({case})"


@pytest.mark.parametrize("which", ["random", "reduced-random"])
def test_negative_control(which, tiny_vocab, ref_probs, eagle8, monkeypatch):
    """A verifier that accepts every draft (chain and tree) must fail the same test."""
    from leaplm.sampling.positional import race
    from leaplm.verify import VerifyResult

    def accept_tree(nodes, parents, p, seed, base):
        """Keeps the first child at every level, then the target's sample after the leaf."""
        accept_tree.calls += 1
        path, row = [], -1
        while (nxt := next((i for i, par in enumerate(parents) if par == row), None)) is not None:
            path.append(nxt)
            row = nxt
        bonus = int(race(p[row + 1: row + 2], seed, [base + len(path)])[0])
        toks = nodes.tolist()
        return VerifyResult(tokens=[toks[c] for c in path] + [bonus], accepted=len(path), path=path)
    accept_tree.calls = 0
    for name, m in list(sys.modules.items()):
        if name.startswith("leaplm.engine"):
            if hasattr(m, "verify_coupled"):
                monkeypatch.setattr(m, "verify_coupled", always_accept)
            if hasattr(m, "verify_tree_coupled"):
                monkeypatch.setattr(m, "verify_tree_coupled", accept_tree)
    always_accept.calls = 0
    monkeypatch.setattr(eagle_mod, "TreeShape", lambda: TreeShape(3, 2))
    exact = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**PLAIN), ref_probs)
    eng = Engine(tiny_vocab["target"], draft=tiny_vocab["near"], method="draft", k=4, head=eagle8[which],
                 adaptive_k=False)
    got = sample_in_batches(eng, PLAIN, kinds=[("eagle", 4), ("eagle", 3), ("none", None)])
    tv, bound = tv_and_bound(got, exact, N)
    assert always_accept.calls + accept_tree.calls >= N // 2
    assert tv > bound, f"the wrong verifier passed: TV {tv:.4f} < bound {bound:.4f}"

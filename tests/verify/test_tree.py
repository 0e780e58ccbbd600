"""Tree verification (verify/tree.py): greedy walks, and the exact algebra of multi-candidate rejection sampling.

Exactness is computed on the real function, without sampling noise: `Replay` stands in for `torch` inside the
module, so every uniform u becomes a symbol and every comparison `u * s < t` follows a script of accept /
reject decisions while the run's probability multiplies by P(u * s < t) or its complement; the categorical draw
records the distribution it was asked to sample from. Replaying every decision script enumerates all that one
verification can emit, with its probability.

Lossless criterion: for every emitted prefix s after which the step goes on, the next emitted token is
distributed exactly as p(s). (Later steps sample from p themselves, so then the whole output is distributed
as sampling from the target alone.)
"""
from __future__ import annotations

import importlib
import itertools
from collections import defaultdict

import pytest
import torch

from leaplm.verify import VerifyResult, verify_greedy, verify_tree_greedy, verify_tree_rejection

tree_mod = importlib.import_module("leaplm.verify.tree")

SHAPES = {
    "chain": [-1, 0, 1, 2],
    "star": [-1, -1, -1, -1],
    "binary": [-1, -1, 0, 0, 1, 1],
    "mixed": [-1, 0, 0, -1, 3, 1, 5],
}


# --- greedy ---------------------------------------------------------------------------------------------------
def argmax_rows(tokens_per_row: list[int]) -> torch.Tensor:
    return torch.tensor(tokens_per_row)


def test_greedy_follows_the_branch_agreeing_with_the_target():
    # root -> {5: n0, 7: n1}; n1 -> {2: n2, 3: n3}; n3 -> {4: n4}
    nodes, parents = torch.tensor([5, 7, 2, 3, 4]), [-1, -1, 1, 1, 3]
    # target argmax per row: root 7, n0 9, n1 3, n2 0, n3 4, n4 6
    r = verify_tree_greedy(nodes, parents, argmax_rows([7, 9, 3, 0, 4, 6]))
    assert r == VerifyResult(tokens=[7, 3, 4, 6], accepted=3, path=[1, 3, 4])


def test_greedy_none_accepted_emits_the_target_token():
    nodes, parents = torch.tensor([5, 6, 7]), [-1, -1, 0]
    r = verify_tree_greedy(nodes, parents, argmax_rows([1, 2, 3, 4]))
    assert r == VerifyResult(tokens=[1], accepted=0, path=[])


def test_greedy_empty_tree():
    r = verify_tree_greedy(torch.empty(0, dtype=torch.long), [], argmax_rows([4]))
    assert r == VerifyResult(tokens=[4], accepted=0, path=[])


@pytest.mark.parametrize("seed", range(20))
def test_greedy_chain_tree_equals_chain_verifier(seed):
    g = torch.Generator().manual_seed(seed)
    K = 5
    drafts = torch.randint(0, 3, (K,), generator=g)
    target = torch.randint(0, 3, (K + 1,), generator=g)
    tree = verify_tree_greedy(drafts, list(range(-1, K - 1)), target)
    chain = verify_greedy(drafts, target)
    assert (tree.tokens, tree.accepted) == (chain.tokens, chain.accepted)
    assert tree.path == list(range(tree.accepted))


# --- exact enumeration of the real verifier ---------------------------------------------------------------------
class Replay:
    """Stands in for `torch` inside verify/tree.py (see the module docstring)."""

    def __init__(self, script: list[bool]):
        self.script = script
        self.taken: list[bool] = []       # decisions of this run: the script, then "accept" past its end
        self.prob = 1.0
        self.drawn: torch.Tensor | None = None

    def __getattr__(self, name):
        return getattr(torch, name)

    def rand(self, n, generator=None, device=None):
        return _Uniforms(self, n)

    def multinomial(self, probs, n, generator=None):
        self.drawn = probs.double().clone()
        return torch.zeros(1, dtype=torch.long)

    def decide(self, chance: float) -> bool:
        i = len(self.taken)
        accept = self.script[i] if i < len(self.script) else True
        self.taken.append(accept)
        self.prob *= chance if accept else 1.0 - chance
        return accept


class _Uniforms:
    def __init__(self, replay: Replay, n: int):
        self.replay, self.n = replay, n

    def tolist(self):
        return [_U(self.replay) for _ in range(self.n)]


class _U:
    """u * scale for u ~ U[0, 1): comparing it with t asks the replay for a decision of chance P(u * scale < t)."""

    def __init__(self, replay: Replay, scale: float = 1.0):
        self.replay, self.scale = replay, scale

    def __mul__(self, s):
        return _U(self.replay, self.scale * float(s))

    def __lt__(self, t):
        t, s = float(t), self.scale
        return self.replay.decide(min(1.0, max(0.0, t / s)) if s > 0 else float(t > 0))


def exact_outcomes(tokens: list[int], parents: list[int], q, p, monkeypatch) -> dict[tuple, float]:
    """{emitted sequence: probability} of verify_tree_rejection on this tree, by replaying every decision."""
    out: dict[tuple, float] = defaultdict(float)
    scripts: list[list[bool]] = [[]]
    while scripts:
        script = scripts.pop()
        shim = Replay(script)
        monkeypatch.setattr(tree_mod, "torch", shim)
        monkeypatch.setattr(tree_mod, "sample_categorical", lambda probs, generator=None: shim.multinomial(probs, 1))
        res = verify_tree_rejection(torch.tensor(tokens, dtype=torch.long), parents, q, p, None)
        for j in range(len(script), len(shim.taken)):      # each default decision may go the other way
            scripts.append(shim.taken[:j] + [False])
        assert res.accepted == len(res.path) == len(res.tokens) - 1
        assert res.tokens[:-1] == [tokens[c] for c in res.path]
        if shim.prob == 0:
            continue
        assert abs(float(shim.drawn.sum()) - 1) < 1e-9 and bool((shim.drawn >= 0).all())
        for y, py in enumerate(shim.drawn.tolist()):
            if py > 0:
                out[tuple(res.tokens[:-1]) + (y,)] += shim.prob * py
    monkeypatch.setattr(tree_mod, "torch", torch)
    return dict(out)


# --- a target and a draft as functions of the prefix ------------------------------------------------------------
class PrefixModel:
    """prefix -> a random distribution over V tokens, fixed per prefix, some tokens exactly 0 (as after top-k)."""

    def __init__(self, V: int, seed: int, zeros: bool = True):
        self.V, self.seed, self.zeros = V, seed, zeros
        self.table: dict[tuple, torch.Tensor] = {}

    def __call__(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self.table:
            g = torch.Generator().manual_seed(hash((self.seed, prefix)) % (1 << 31))
            x = torch.randn(self.V, generator=g, dtype=torch.float64) * 2
            if self.zeros:
                drop = torch.rand(self.V, generator=g, dtype=torch.float64) < 0.25
                drop[int(x.argmax())] = False
                x[drop] = float("-inf")
            self.table[prefix] = x.softmax(-1)
        return self.table[prefix]


def prefixes(parents: list[int], tokens: list[int]) -> list[tuple]:
    """The token prefix ending at each block row (row 0, the root: the empty prefix)."""
    out = [()]
    for i, par in enumerate(parents):
        out.append(out[par + 1] + (tokens[i],))
    return out


def outcomes_deterministic(parents, tokens, p_model, monkeypatch) -> dict[tuple, float]:
    p = torch.stack([p_model(s) for s in prefixes(parents, tokens)])                  # [K+1, V]
    return exact_outcomes(tokens, parents, None, p, monkeypatch)


def outcomes_sampled(parents, p_model, q_model, monkeypatch) -> dict[tuple, float]:
    """Every node drawn independently from q at its parent's prefix: average over all draws."""
    out: dict[tuple, float] = defaultdict(float)
    for tokens in itertools.product(range(p_model.V), repeat=len(parents)):
        tokens = list(tokens)
        pre = prefixes(parents, tokens)
        q = torch.stack([q_model(pre[par + 1]) for par in parents])                   # [K, V]
        w = float(torch.prod(q[torch.arange(len(tokens)), tokens]))
        if w == 0:
            continue
        p = torch.stack([p_model(s) for s in pre])                                     # [K+1, V]
        for seq, pr in exact_outcomes(tokens, parents, q, p, monkeypatch).items():
            out[seq] += w * pr
    return dict(out)


def lossless_error(outcomes: dict[tuple, float], p_model) -> float:
    """Largest |P(next = x | prefix s emitted and the step goes on) - p(s)(x)| over prefixes s and tokens x."""
    assert abs(sum(outcomes.values()) - 1) < 1e-9
    joint: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros(p_model.V, dtype=torch.float64))
    for seq, prob in outcomes.items():
        for j in range(len(seq)):
            joint[seq[:j]][seq[j]] += prob
    return max(float((row / row.sum() - p_model(s)).abs().max()) for s, row in joint.items() if row.sum() > 1e-12)


TOL = 1e-6


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(4))
def test_deterministic_candidates_are_exact(shape, seed, monkeypatch):
    """Any fixed candidates, duplicates among siblings and tokens p rules out included."""
    parents = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (len(parents),), generator=g).tolist()
    p = PrefixModel(5, seed)
    assert lossless_error(outcomes_deterministic(parents, tokens, p, monkeypatch), p) < TOL


def test_every_order_of_distinct_siblings_is_exact(monkeypatch):
    p = PrefixModel(4, 3)
    for perm in itertools.permutations(range(4), 3):
        assert lossless_error(outcomes_deterministic([-1, -1, -1], list(perm), p, monkeypatch), p) < TOL


@pytest.mark.parametrize("shape", ["chain", "star", "binary"])
@pytest.mark.parametrize("seed", range(3))
def test_sampled_candidates_are_exact(shape, seed, monkeypatch):
    parents = SHAPES[shape][:4]
    p, q = PrefixModel(3, seed), PrefixModel(3, seed + 100, zeros=False)
    assert lossless_error(outcomes_sampled(parents, p, q, monkeypatch), p) < TOL


# --- negative controls: the enumeration catches wrong rules ------------------------------------------------------
def _no_renormalisation(kids, toks, p_x, u, p_row):
    """Wrong: accepts a later sibling with p(x) instead of p(x) / (1 - mass already rejected)."""
    tried = []
    for c in kids:
        if toks[c] in tried:
            continue
        if u[c] < p_x[c]:
            return c, None
        tried.append(toks[c])
    r = p_row.clone()
    r[tried] = 0
    return None, (r / r.sum() if r.sum() > 0 else p_row)


def _residual_not_updated(kids, toks, q, u, p_row):
    """Wrong: tests every sibling against p itself, never against the residual."""
    for c in kids:
        if u[c] * float(q[c, toks[c]]) < float(p_row[toks[c]]):
            return c, None
    return None, tree_mod.residual(p_row, q[kids[-1]]) if kids else p_row


def test_enumeration_catches_missing_renormalisation(monkeypatch):
    p = PrefixModel(5, 0)
    tokens, parents = [2, 0, 3, 1], [-1, -1, -1, 0]
    assert lossless_error(outcomes_deterministic(parents, tokens, p, monkeypatch), p) < TOL
    monkeypatch.setattr(tree_mod, "_try_deterministic", _no_renormalisation)
    assert lossless_error(outcomes_deterministic(parents, tokens, p, monkeypatch), p) > 1e-2


def test_enumeration_catches_a_stale_residual(monkeypatch):
    p, q = PrefixModel(3, 1), PrefixModel(3, 101, zeros=False)
    monkeypatch.setattr(tree_mod, "_try_sampled", _residual_not_updated)
    assert lossless_error(outcomes_sampled(SHAPES["star"][:3], p, q, monkeypatch), p) > 1e-2


def test_enumeration_catches_recovering_from_p(monkeypatch):
    p, q = PrefixModel(3, 2), PrefixModel(3, 102, zeros=False)
    monkeypatch.setattr(tree_mod, "residual", lambda p_, q_: p_)
    assert lossless_error(outcomes_sampled(SHAPES["binary"][:4], p, q, monkeypatch), p) > 1e-2


# --- plumbing --------------------------------------------------------------------------------------------------
def test_rejection_on_an_empty_tree_samples_p():
    p = torch.tensor([[0.0, 1.0, 0.0]])
    r = verify_tree_rejection(torch.empty(0, dtype=torch.long), [], None, p, torch.Generator().manual_seed(0))
    assert r == VerifyResult(tokens=[1], accepted=0, path=[])


def test_certain_candidate_accepted_impossible_one_rejected():
    # root p: all mass on 2; node 0 (token 1) impossible, node 1 (token 2) certain, then a bonus from row 2
    p = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    for s in range(10):
        r = verify_tree_rejection(torch.tensor([1, 2]), [-1, -1], None, p, torch.Generator().manual_seed(s))
        assert r == VerifyResult(tokens=[2, 1], accepted=1, path=[1])


def test_same_seed_same_result():
    p = torch.stack([PrefixModel(6, 0)((i,)) for i in range(5)]).float()
    nodes, parents = torch.tensor([1, 2, 3, 4]), [-1, -1, 0, 2]
    a = verify_tree_rejection(nodes, parents, None, p, torch.Generator().manual_seed(5))
    b = verify_tree_rejection(nodes, parents, None, p, torch.Generator().manual_seed(5))
    assert a == b

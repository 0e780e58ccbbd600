"""Exact algebra of speculative rejection sampling (verify/rejection.py), no sampling noise.

verify_rejection draws from its generator twice: u ~ U[0, 1)^K (torch.rand) and the recovered or bonus token
(sampling/categorical.py). `Branches` replaces both inside the module: rand returns a chosen u, the draw records
the distribution it was asked to sample from. Running the real function at the midpoint of every interval of u
between breakpoints (every ratio p/q, q/p, p, q the function could threshold on, plus a grid), weighting by
the interval's length, gives the exact distribution of what it emits. Lossless means that distribution is
the target's: the first emitted token ~ p_0, and jointly the first two ~ p_0(y1) p_1(y2 | y1).
"""
from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass, field

import pytest
import torch

from leaplm.verify import verify_rejection

rejection = importlib.import_module("leaplm.verify.rejection")

GRID = [i / 16 for i in range(17)]


@dataclass
class Branches:
    """Stands in for `torch` inside verify/rejection.py: deterministic u, recorded sampling distributions."""
    u: torch.Tensor = None
    drawn: list = field(default_factory=list)

    def __getattr__(self, name):
        return getattr(torch, name)

    def rand(self, *size, generator=None, device=None):
        return self.u.clone()

    def multinomial(self, probs, n, generator=None):
        self.drawn.append(probs.detach().clone())
        return torch.zeros(1, dtype=torch.long)


def u_intervals(p_x: float, q_x: float | None) -> list[tuple[float, float]]:
    """(midpoint, length) of the intervals of [0, 1) between every point the accept test could switch at."""
    pts = set(GRID) | {min(1.0, p_x)}
    if q_x is not None:
        pts |= {min(1.0, q_x)}
        if q_x > 0:
            pts.add(min(1.0, p_x / q_x))
        if p_x > 0:
            pts.add(min(1.0, q_x / p_x))
    pts = sorted(pts)
    return [((a + b) / 2, b - a) for a, b in zip(pts, pts[1:]) if b > a]


def emitted_joint(p_fn, q_fn, K: int, V: int, n_out: int, monkeypatch, draft_fn=None) -> torch.Tensor:
    """Exact joint distribution [V]*n_out of the first n_out tokens when one verify step runs on K drafts and,
    if it emits fewer than n_out, the rest are sampled from the target (as the following steps would).

    p_fn(prefix) -> p [V] of the target after the generated `prefix`; q_fn likewise for the proposer, and the
    drafts are sampled from q. With draft_fn(prefix) -> token the proposer is deterministic (q = None)."""
    shim = Branches()
    monkeypatch.setattr(rejection, "torch", shim)
    monkeypatch.setattr(rejection, "sample_categorical", lambda probs, generator=None: shim.multinomial(probs, 1))
    out = torch.zeros([V] * n_out, dtype=torch.float64)

    def add(seq: tuple, w: float) -> None:               # complete seq with the target, truncate to n_out
        if w == 0:
            return
        if len(seq) >= n_out:
            out[seq[:n_out]] += w
            return
        for y, py in enumerate(p_fn(seq).tolist()):
            add(seq + (y,), w * py)

    if draft_fn is not None:
        x: tuple = ()
        for _ in range(K):
            x += (draft_fn(x),)
        chains = [(x, 1.0)]
    else:
        chains = []
        for x in itertools.product(range(V), repeat=K):
            w = 1.0
            for i in range(K):
                w *= float(q_fn(x[:i])[x[i]])
            if w > 0:
                chains.append((x, w))
    for x, w_chain in chains:
        p = torch.stack([p_fn(x[:i]) for i in range(K + 1)])                       # [K+1, V]
        q = torch.stack([q_fn(x[:i]) for i in range(K)]) if draft_fn is None else None   # [K, V]
        per_pos = [u_intervals(float(p[i, x[i]]), None if q is None else float(q[i, x[i]])) for i in range(K)]
        for us in itertools.product(*per_pos):
            shim.u = torch.tensor([m for m, _ in us], dtype=p.dtype)
            shim.drawn.clear()
            res = verify_rejection(torch.tensor(x, dtype=torch.long), q, p, generator=None)
            assert len(res.tokens) == res.accepted + 1 and len(shim.drawn) == 1
            assert list(res.tokens[: res.accepted]) == list(x[: res.accepted])
            w = w_chain
            for _, length in us:
                w *= length
            dist = shim.drawn[0].double()
            assert torch.all(dist >= 0) and abs(float(dist.sum()) - 1) < 1e-5
            for y, py in enumerate(dist.tolist()):
                add(tuple(res.tokens[:-1]) + (y,), w * py)
    return out


def target_joint(p_fn, V: int, n_out: int) -> torch.Tensor:
    out = torch.zeros([V] * n_out, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=n_out):
        w = 1.0
        for i in range(n_out):
            w *= float(p_fn(seq[:i])[seq[i]])
        out[seq] = w
    return out


def random_dist(g: torch.Generator, V: int, zero_frac: float = 0.3) -> torch.Tensor:
    """A peaked distribution with some exact zeros (as top-k/top-p/min-p leave), never all zero."""
    x = torch.randn(V, generator=g, dtype=torch.float64) * 2
    drop = torch.rand(V, generator=g, dtype=torch.float64) < zero_frac
    drop[int(torch.argmax(x))] = False
    x[drop] = float("-inf")
    return x.softmax(-1).float()


def conditional(seed: int, V: int, zero_frac: float = 0.3):
    """prefix -> a fixed random distribution: the 'model' whose next-token distribution depends on the prefix."""
    cache: dict = {}

    def fn(prefix: tuple) -> torch.Tensor:
        if prefix not in cache:
            g = torch.Generator().manual_seed(hash((seed, prefix)) % (1 << 31))
            cache[prefix] = random_dist(g, V, zero_frac)
        return cache[prefix]

    return fn


def const(d: torch.Tensor):
    return lambda prefix: d


TOL = 1e-5


# --- the first emitted token ~ p --------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_first_token_is_p_for_random_p_and_q(seed, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    p, q = random_dist(g, 6), random_dist(g, 6)
    got = emitted_joint(const(p), const(q), K=1, V=6, n_out=1, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, p.double(), atol=TOL, rtol=0)


def test_disjoint_supports_always_recover_from_p(monkeypatch):
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.0, 0.6, 0.4])
    got = emitted_joint(const(p), const(q), K=1, V=5, n_out=1, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, p.double(), atol=TOL, rtol=0)


def test_p_equal_q_always_accepts(monkeypatch):
    p = torch.tensor([0.1, 0.6, 0.3])
    got = emitted_joint(const(p), const(p), K=1, V=3, n_out=1, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, p.double(), atol=TOL, rtol=0)
    for x in range(3):                                       # and really accepts: never a recovered token
        monkeypatch.setattr(rejection, "torch", Branches(u=torch.tensor([0.999])))
        res = verify_rejection(torch.tensor([x]), p.view(1, -1), torch.stack([p, p]), generator=None)
        assert res.accepted == 1


@pytest.mark.parametrize("x", range(5))
def test_one_hot_draft_gives_p_for_every_draft_token(x, monkeypatch):
    """q = None (a deterministic proposer): whatever the token proposed, the first emitted token ~ p,
    including a token p gives zero probability (index 4)."""
    p = torch.tensor([0.4, 0.25, 0.2, 0.15, 0.0])
    got = emitted_joint(const(p), None, K=1, V=5, n_out=1, monkeypatch=monkeypatch, draft_fn=lambda prefix: x)
    torch.testing.assert_close(got, p.double(), atol=TOL, rtol=0)


@pytest.mark.parametrize("one_hot", [False, True])
def test_one_token_vocabulary(one_hot, monkeypatch):
    one = torch.ones(1)
    got = emitted_joint(const(one), None if one_hot else const(one), K=2, V=1, n_out=2, monkeypatch=monkeypatch,
                        draft_fn=(lambda prefix: 0) if one_hot else None)
    assert got.tolist() == [[1.0]]
    res = verify_rejection(torch.tensor([0, 0]), None, torch.ones(3, 1), torch.Generator().manual_seed(0))
    assert res.tokens == [0, 0, 0] and res.accepted == 2


# --- several tokens: accepted, recovered and bonus together -----------------------------------------------------
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("seed", range(2))
def test_first_two_tokens_jointly_follow_the_target(K, seed, monkeypatch):
    """p and q depend on the prefix (as a model's do). K = 1: the second token is the bonus or comes from the
    next step; K = 2: accepted, recovered at position 2, or accepted twice."""
    V = 4
    p_fn, q_fn = conditional(seed, V), conditional(seed + 100, V)
    got = emitted_joint(p_fn, q_fn, K=K, V=V, n_out=2, monkeypatch=monkeypatch)
    torch.testing.assert_close(got, target_joint(p_fn, V, 2), atol=TOL, rtol=0)


def test_first_two_tokens_with_a_deterministic_chain(monkeypatch):
    V = 4
    p_fn = conditional(3, V)
    got = emitted_joint(p_fn, None, K=2, V=V, n_out=2, monkeypatch=monkeypatch,
                        draft_fn=lambda prefix: (len(prefix) * 3 + 1) % V)
    torch.testing.assert_close(got, target_joint(p_fn, V, 2), atol=TOL, rtol=0)


# --- controls: the enumeration catches the classic mistakes ------------------------------------------------------
@pytest.mark.parametrize("mistake", ["recover_from_p", "p_and_q_swapped"])
def test_enumeration_detects_a_wrong_residual(mistake, monkeypatch):
    g = torch.Generator().manual_seed(0)
    p, q = random_dist(g, 6, 0.0), random_dist(g, 6, 0.0)
    if mistake == "recover_from_p":
        monkeypatch.setattr(rejection, "residual", lambda p_, q_: p_)
    else:
        monkeypatch.setattr(rejection, "residual", lambda p_, q_: (q_ - p_).clamp_min(0) / (q_ - p_).clamp_min(0).sum())
    wrong = emitted_joint(const(p), const(q), K=1, V=6, n_out=1, monkeypatch=monkeypatch)
    assert (wrong - p.double()).abs().sum() > 100 * TOL


# --- plumbing ------------------------------------------------------------------------------------------------------
def test_same_seed_same_result_and_residual_formula():
    g = torch.Generator().manual_seed(1)
    p = torch.stack([random_dist(g, 8) for _ in range(4)])
    q = torch.stack([random_dist(g, 8) for _ in range(3)])
    draft = q.argmax(-1)
    a = verify_rejection(draft, q, p, torch.Generator().manual_seed(5))
    b = verify_rejection(draft, q, p, torch.Generator().manual_seed(5))
    assert a == b
    r = rejection.residual(p[0], q[0])
    expect = (p[0] - q[0]).clamp_min(0)
    torch.testing.assert_close(r, expect / expect.sum())
    torch.testing.assert_close(rejection.residual(p[0], p[0]), p[0])   # no mass left: p itself

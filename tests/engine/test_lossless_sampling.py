"""Lossless sampling through the real engine, by Monte Carlo on a vocabulary of 8 tokens.

The statistic: the joint distribution of generated positions 2 and 3 (both after speculation has started:
position 1 already comes from a speculative step, so 2 and 3 cover accepted, recovered and bonus tokens and
the rollbacks between steps), estimated from N generations with seeds 0..N-1, against the exact target
distribution enumerated from the target model through transformers and transformers' own processors
(`reference_probs`), independently of leaplm's model and sampling code.

The bound: cells of the exact distribution with probability >= 0.01 are kept, the rest merged into one, fixed
before sampling (k cells in all). Weissman et al. (2003): P(||p_hat - p||_1 >= e) <= (2^k - 2) exp(-N e^2 / 2),
so with TV = ||.||_1 / 2, P(TV >= t) <= 2^k exp(-2 N t^2) = DELTA gives t = sqrt((k ln 2 + ln(1 / DELTA)) / 2N).
A correct engine exceeds it with probability below DELTA = 1e-6; the seeds are fixed, so the outcome is too.
Both sampled verifiers run through it: the exponential race (seeded requests) and rejection sampling (requests
without a seed, here asked for by SamplingParams.verifier with a seed so the run is reproducible). Each has a
negative control: the same test with a broken verifier, which must exceed the bound.
"""
from __future__ import annotations

import itertools
import math
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.sampling.positional import race
from leaplm.verify import VerifyResult
from mc_bounds import DELTA, MIN_CELL, tv_and_bound  # noqa: F401  (shared bound, see its docstring)

N = 1500
PROMPT = [1, 2, 3]

PLAIN = dict()
PROCESSED = dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.3)


def exact_positions_2_3(path: str, params: SamplingParams, reference_probs) -> torch.Tensor:
    """P(y2 = a, y3 = b) [V, V] = sum over y1 of p(y1) p(y2 | y1) p(y3 | y1, y2), by enumeration."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    V = model.config.vocab_size

    def next_probs(prefixes: list[tuple]) -> torch.Tensor:                     # [len(prefixes), V]
        ids = torch.tensor([PROMPT + list(pre) for pre in prefixes])
        with torch.no_grad():
            logits = model(ids).logits[:, -1]
        return reference_probs(logits, [PROMPT + list(pre) for pre in prefixes], params).double()

    p1 = next_probs([()])[0]                                                      # [V]
    p2 = next_probs([(a,) for a in range(V)])                                     # [V(y1), V]
    pairs = list(itertools.product(range(V), repeat=2))
    p3 = next_probs(pairs).view(V, V, V)                                          # [y1, y2, y3]
    joint = torch.einsum("a,ab,abc->bc", p1, p2, p3)                              # [y2, y3]
    assert abs(float(joint.sum()) - 1) < 1e-6
    return joint


def sample_positions_2_3(engine: Engine, params: dict, n: int = N) -> tuple[torch.Tensor, float]:
    """Empirical joint [V, V] of positions 2 and 3 over seeds 0..n-1, and the acceptance rate seen (params may
    name the verifier)."""
    V = engine.model.vocab_size
    counts = torch.zeros(V, V, dtype=torch.float64)
    drafted = accepted = 0
    for seed in range(n):
        out = engine.generate(PROMPT, SamplingParams(max_new_tokens=3, seed=seed, ignore_eos=True, **params))
        assert len(out.token_ids) == 3
        counts[out.token_ids[1], out.token_ids[2]] += 1
        drafted += out.stats.draft_tokens
        accepted += out.stats.accepted_tokens
    return counts / n, accepted / max(drafted, 1)


def engine(tiny_vocab, method: str, draft: str | None = None, k: int = 2) -> Engine:
    """adaptive_k off: K is then fixed, so the run is a function of the seeds alone."""
    if method == "none":
        return Engine(tiny_vocab["target"], method="none")
    return Engine(tiny_vocab["target"], draft=tiny_vocab[draft], method="draft", k=k, adaptive_k=False)


CASES = {
    # name: (sampling params, draft, K)
    "plain-far-k2": (PLAIN, "far", 2),
    "processed-near-k3": (PROCESSED, "near", 3),
}


@pytest.mark.parametrize("verifier", ["race", "rejection"])
@pytest.mark.parametrize("method", ["none", "draft"])
@pytest.mark.parametrize("case", list(CASES))
def test_positions_2_and_3_follow_the_target(case, method, verifier, tiny_vocab, ref_probs):
    params, draft, k = CASES[case]
    exact = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**params), ref_probs)
    eng = engine(tiny_vocab, method, draft, k)
    got, acceptance = sample_positions_2_3(eng, dict(params, verifier=verifier))
    if method == "draft":                # the regimes the drafts were built for: both branches well exercised
        # (the race keeps P(argmax q/E = argmax p/E), see sampling/positional.py; rejection 1 - TV(p, q))
        assert (0.05 < acceptance < 0.5) if draft == "far" else (0.4 < acceptance < 0.97), acceptance
    tv, bound = tv_and_bound(got, exact, N)
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f} ({case}, {method}, {verifier})"


def test_rejection_keeps_more_drafts_than_the_race(tiny_vocab):
    """Why rejection sampling is the default without a seed: on the same draft it keeps at least as many tokens
    (1 - TV(p, q) per token against the race's coupling probability), here clearly more."""
    params, draft, k = CASES["processed-near-k3"]
    eng = engine(tiny_vocab, "draft", draft, k)
    _, race_acc = sample_positions_2_3(eng, dict(params, verifier="race"), n=300)
    _, rejection_acc = sample_positions_2_3(eng, dict(params, verifier="rejection"), n=300)
    assert rejection_acc > race_acc + 0.03, (rejection_acc, race_acc)


def always_accept(draft, p, seed, base) -> VerifyResult:
    """A wrong verifier: keeps every draft token and adds the target's sample after them."""
    always_accept.calls += 1
    K = draft.numel()
    bonus = int(race(p[K:], seed, [base + K])[0])
    return VerifyResult(tokens=draft.tolist() + [bonus], accepted=K)


def test_negative_control_always_accept_fails_the_bound(tiny_vocab, ref_probs, monkeypatch):
    """The same test as plain-far-k2/draft with the verifier replaced wherever the engine looks it up."""
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("leaplm.engine") and hasattr(m, "verify_coupled")]
    assert patched
    for m in patched:
        monkeypatch.setattr(m, "verify_coupled", always_accept)
    always_accept.calls = 0
    params, draft, k = CASES["plain-far-k2"]
    exact = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**params), ref_probs)
    got, _ = sample_positions_2_3(engine(tiny_vocab, "draft", draft, k), params)
    tv, bound = tv_and_bound(got, exact, N)
    assert always_accept.calls >= N                                # the wrong verifier really ran
    assert tv > bound, f"the wrong verifier passed: TV {tv:.4f} < bound {bound:.4f}"


def recover_from_p(draft, q, p, generator) -> VerifyResult:
    """A wrong rejection sampler: keeps x with probability min(1, p(x) / q(x)) as it should, but samples the
    token after a rejection from p instead of the residual max(0, p - q), so tokens q over-proposes come twice."""
    recover_from_p.calls += 1
    K = draft.numel()
    kept = []
    for i in range(K):
        x = int(draft[i])
        qx = float(q[i, x]) if q is not None else 1.0
        if float(torch.rand(1, generator=generator)) * qx >= float(p[i, x]):
            return VerifyResult(kept + [int(torch.multinomial(p[i], 1, generator=generator))], i)
        kept.append(x)
    return VerifyResult(kept + [int(torch.multinomial(p[K], 1, generator=generator))], K)


def test_negative_control_rejection_recovering_from_p_fails_the_bound(tiny_vocab, ref_probs, monkeypatch):
    """The rejection path of plain-far-k2/draft with the residual replaced by p wherever the engine looks it up."""
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("leaplm.engine") and hasattr(m, "verify_rejection")]
    assert patched
    for m in patched:
        monkeypatch.setattr(m, "verify_rejection", recover_from_p)
    recover_from_p.calls = 0
    params, draft, k = CASES["plain-far-k2"]
    exact = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**params), ref_probs)
    got, _ = sample_positions_2_3(engine(tiny_vocab, "draft", draft, k), dict(params, verifier="rejection"))
    tv, bound = tv_and_bound(got, exact, N)
    assert recover_from_p.calls >= N                                # the wrong verifier really ran
    assert tv > bound, f"the wrong verifier passed: TV {tv:.4f} < bound {bound:.4f}"


def test_the_exact_distribution_is_not_trivial(tiny_vocab, ref_probs):
    """Control on the statistic: the cases spread mass over enough cells, and the processors change it."""
    plain = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**PLAIN), ref_probs)
    processed = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**PROCESSED), ref_probs)
    for joint in (plain, processed):
        assert int((joint >= MIN_CELL).sum()) >= 6 and float(joint.max()) < 0.6
    assert 0.5 * float((plain - processed).abs().sum()) > 0.1


@pytest.mark.parametrize("verifier", ["auto", "rejection"])
def test_a_seed_reproduces_a_speculative_sample(tiny_vocab, verifier):
    eng = engine(tiny_vocab, "draft", "far", 2)
    runs = [eng.generate(PROMPT, SamplingParams(max_new_tokens=12, seed=s, ignore_eos=True,
                                                verifier=verifier)).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


def test_the_verifier_each_request_runs():
    """auto: the race with a seed (output independent of K and batch), rejection sampling without one."""
    from leaplm.engine.verification import request_verifier
    assert request_verifier(SamplingParams(temperature=0)) == "greedy"
    assert request_verifier(SamplingParams(seed=1)) == "race"
    assert request_verifier(SamplingParams()) == "rejection"
    assert request_verifier(SamplingParams(seed=1, verifier="rejection")) == "rejection"
    assert request_verifier(SamplingParams(verifier="race")) == "race"

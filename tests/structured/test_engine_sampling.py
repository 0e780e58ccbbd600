"""Sampled output under a constraint follows the masked target's distribution, under both sampled verifiers: the
exponential race and rejection sampling (whose sampled drafts keep their first forbidden token, rejected for sure).

Monte Carlo on the 8-letter target: the grammar ((a|b)(c|d|e))+f? allows 2, then 3, then 3 letters at the first
three positions, so the statistic is the joint distribution of the first three generated tokens (18 cells), against
the exact constrained distribution enumerated from transformers' model (its logits, the grammar's masks, softmax at
the request's temperature): independent of leaplm's model, masking and sampling code. Bound (tests/engine/
mc_bounds.py): cells >= MIN_CELL kept, the rest pooled, fixed before sampling; with k cells and N samples
P(TV >= sqrt((k ln 2 + ln(1 / DELTA)) / 2N)) <= DELTA = 1e-6. Seeds are fixed, so the outcome is too.
Negative control: the same test with the step's masking skipped (the verifier sees the raw p) must exceed the
bound; a request whose output leaves the grammar counts in a cell of its own (exact probability 0).
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from leaplm.config import SamplingParams, StructuredOutput
from leaplm.engine.engine import Engine
from letters import letters  # noqa: F401 - the fixture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mc_bounds import MIN_CELL, tv_and_bound  # noqa: E402

GRAMMAR = StructuredOutput(regex="((a|b)(c|d|e))+f?")
PROMPT = [0, 2, 1, 3, 0, 2, 1, 4, 0, 2]            # a c b d a c b e a c: n-gram methods find matches in it
TEMPERATURE = 1.5
N = 1200
N_CONTROL = 400
METHODS = {"none": dict(method="none"), "draft": dict(method="draft", k=3),
           "ngram": dict(method="ngram", k=3), "lookahead": dict(method="lookahead", k=4, window=2, ngram_size=2)}


def exact_first_three(path: str, vocab) -> torch.Tensor:
    """The constrained target's joint distribution [V, V, V] of the first three tokens."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    V = model.config.vocab_size

    def next_probs(prefix: tuple) -> torch.Tensor:                                # [V]
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double()
        state = vocab.state(GRAMMAR)
        state.advance(list(prefix))
        return (logits / TEMPERATURE).masked_fill(~state.allowed(), float("-inf")).softmax(-1)

    joint = torch.zeros(V, V, V, dtype=torch.float64)
    p1 = next_probs(())
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = next_probs((a,))
        for b in range(V):
            if p2[b] > 0:
                joint[a, b] = p1[a] * p2[b] * next_probs((a, b))
    assert abs(float(joint.sum()) - 1) < 1e-9
    return joint


def sample_first_three(engine: Engine, n: int, verifier: str = "race") -> tuple[torch.Tensor, float, int]:
    """Empirical joint [V, V, V] over seeds 0..n-1, the share of requests that left the grammar, drafts accepted."""
    V = engine.model.vocab_size
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    invalid = accepted = 0
    for seed in range(n):
        params = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE, seed=seed, structured=GRAMMAR,
                                verifier=verifier)
        try:
            out = engine.generate(PROMPT, params)
        except RuntimeError:                         # a token the grammar refuses reached the commit
            invalid += 1
            continue
        accepted += out.stats.accepted_tokens + out.stats.forced_accepted
        counts[tuple(out.token_ids)] += 1
    return counts / n, invalid / n, accepted


@pytest.fixture(scope="module")
def exact(letters):
    from letters import letter_tokenizer

    from leaplm.structured.state import GrammarVocab

    joint = exact_first_three(letters["target"].path, GrammarVocab(letter_tokenizer(), 8, []))
    assert int((joint >= MIN_CELL).sum()) >= 8 and float(joint.max()) < 0.5    # a spread-out statistic
    return joint


def engine_for(letters, method: str) -> Engine:
    opts = METHODS[method]
    return Engine(letters["target"], letters["near"] if method == "draft" else None, adaptive_k=False, **opts)


@pytest.mark.parametrize("method, verifier", [(m, "race") for m in METHODS] +
                         [(m, "rejection") for m in ("draft", "ngram", "lookahead")])
def test_sampling_follows_the_constrained_target(method, verifier, letters, exact):
    got, invalid, accepted = sample_first_three(engine_for(letters, method), N, verifier)
    assert invalid == 0
    if method != "none":
        assert accepted > N // 10                  # speculation really happened, often enough to matter
    tv, bound = tv_and_bound(got, exact, N)
    assert tv < bound, f"{method}, {verifier}: TV {tv:.4f} >= bound {bound:.4f}"


@pytest.mark.parametrize("method, verifier", [("none", "race"), ("draft", "rejection")])
def test_negative_control_unmasked_verification_fails_the_bound(method, verifier, letters, exact, monkeypatch):
    import leaplm.engine.commit as step

    monkeypatch.setattr(step, "masked", lambda logits, rc: logits)
    got, invalid, _ = sample_first_three(engine_for(letters, method), N_CONTROL, verifier)
    V = got.shape[0]
    cells = torch.cat([got.flatten(), torch.tensor([invalid], dtype=torch.float64)])
    exact_cells = torch.cat([exact.flatten(), torch.zeros(1, dtype=torch.float64)])
    tv, bound = tv_and_bound(cells, exact_cells, N_CONTROL)
    assert invalid > 0 and tv > bound, f"{method}: the unmasked verifier passed: TV {tv:.4f} <= {bound:.4f}"
    assert V == 8

"""`leaplm bench agree`: greedy agreement of leaplm and libllama with each disagreement's logit gaps. Scripted
backends pin the arithmetic (where the continuations part, the gaps, z against the measured rounding spread); a tiny
GGUF file runs both real backends through the engine."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from leaplm.bench.agreement import Divergence, agreement, compare, engine_backend, rounding_noise
from leaplm.models.llamacpp.binding import available

V = 50


def scripted(tokens: list[int]):
    def decode(ids, n):
        return tokens[:n]
    return decode


def scorer(base: torch.Tensor, favour: dict[int, float]):
    """Logits `base` [V] with the tokens in `favour` raised by their values."""
    def score(ids):
        x = base.clone()
        for t, v in favour.items():
            x[t] += v
        return x
    return score


def test_identical_continuations_have_no_divergence():
    p = compare("p", [1, 2], 4, scripted([3, 4, 5, 6]), scripted([3, 4, 5, 6]), None, None)
    assert p.identical and p.agreed == 4 == p.tokens


def test_the_first_difference_is_scored_on_the_common_prefix():
    seen = []
    base = torch.zeros(V)

    def ours(ids):
        seen.append(list(ids))
        return scorer(base, {7: 10.0, 8: 9.9})(ids)

    p = compare("p", [1, 2], 5, scripted([3, 4, 7, 1, 1]), scripted([3, 4, 8, 2, 2]), ours,
                scorer(base, {7: 9.8, 8: 10.0}))
    assert (p.agreed, p.divergence.position, p.divergence.ours, p.divergence.theirs) == (2, 2, 7, 8)
    assert seen == [[1, 2, 3, 4]]                                    # prompt + the agreed tokens
    assert p.divergence.our_gap == pytest.approx(0.1, abs=1e-5) and p.divergence.their_gap == pytest.approx(0.2, abs=1e-5)


def test_z_measures_the_disagreement_against_the_backends_rounding_spread():
    g = torch.Generator().manual_seed(0)
    ours = torch.randn(V, generator=g) * 5
    noise = torch.randn(V, generator=g) * 0.1
    theirs = ours + noise
    assert rounding_noise(ours, theirs, top=V) == pytest.approx(float(noise.std()), rel=1e-5)
    tie = Divergence(0, 1, 2, 0.05, 0.05, 0.1)
    bug = Divergence(0, 1, 2, 3.0, 0.0, 0.1)                       # ours prefers its token by 30 sigma
    assert tie.z < 1 < 3 < bug.z


def test_the_report_counts_identical_prompts_and_unexplained_disagreements():
    base = torch.randn(V, generator=torch.Generator().manual_seed(1))
    other = base + 0.05 * torch.randn(V, generator=torch.Generator().manual_seed(2))   # the other arithmetic's rounding
    close = scorer(base, {7: 3.0, 8: 2.99 - float(base[8] - base[7])}), \
        scorer(other, {7: 2.99 - float(other[7] - other[8]), 8: 3.0})
    far = scorer(base, {7: 9.0, 8: 1.0}), scorer(other, {7: 0.99, 8: 1.0 + float(other[7] - other[8])})
    prompts = [("a", [1]), ("b", [1]), ("c", [1])]
    decoders = {"a": (scripted([7, 7]), scripted([7, 7])), "b": (scripted([7]), scripted([8])),
                "c": (scripted([7]), scripted([8]))}

    def run(scorers):
        rep = agreement("m", prompts[:1], 2, *decoders["a"], *scorers, near_tie=3.0)
        for name in "bc":
            rep.prompts.append(compare(name, [1], 1, *decoders[name], *scorers))
        return rep

    tied = run(close)
    assert tied.identical_share == pytest.approx(1 / 3) and tied.unexplained == []
    broken = run(far)                                                # a control: a gap no rounding explains
    assert len(broken.unexplained) == 2
    assert broken.to_dict()["unexplained"] == 2


@pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")
def test_leaplm_and_libllama_agree_on_a_tiny_file_up_to_near_ties(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from gguf_writer import write_tiny_gguf
    from leaplm.models.loading import load_model

    path, _ = write_tiny_gguf(tmp_path, "Q8_0")
    ours, theirs = load_model(path, backend="torch", quantization="gguf"), load_model(path, backend="llamacpp")
    a, b = engine_backend(ours), engine_backend(theirs)
    prompts = [(t, a.encode(t)) for t in ("hello world", "abcabcabc", "the cat sat")]
    rep = agreement(path, prompts, 16, a.decode, b.decode, a.score, b.score, near_tie=3.0)
    assert [p.tokens for p in rep.prompts] == [16] * 3
    assert rep.unexplained == [], [p.divergence for p in rep.unexplained]
    for p in rep.prompts:                          # where they part, each backend preferred its own token
        assert p.divergence is None or p.divergence.our_gap >= 0

"""Acceptance priors (engine/kpolicy/priors.py): a request starts from what the process measured of its proposer
in its temperature band, else from the proposer's card. Deterministic, no model."""
from __future__ import annotations

from pathlib import Path

import pytest

import leaplm
from leaplm.engine.kpolicy.estimates import Estimates
from leaplm.engine.kpolicy.policy import KPolicy
from leaplm.engine.kpolicy.priors import acceptance_band, card_acceptance, rate_from_tau, shared, temperature_band

DRAFT_1M = Path(leaplm.__file__).parent / "embedded" / "draft-1m"


def test_rate_from_tau_inverts_the_geometric_chain():
    for a in (0.1, 0.5, 0.8):
        assert rate_from_tau(sum(a ** i for i in range(5)), 4) == pytest.approx(a, abs=1e-6)


def test_the_shipped_drafts_card_gives_a_rate_per_band():
    """draft-1m's card: mean accepted length 3.4 at T = 0 and 2.09 at T = 0.8 with K = 4."""
    card = card_acceptance(DRAFT_1M)
    assert card["greedy"] == pytest.approx(rate_from_tau(3.4, 4))
    assert card["mid"] == pytest.approx(rate_from_tau(2.09, 4))
    assert card["greedy"] > card["mid"]
    assert card_acceptance(DRAFT_1M.parent / "no-such-model") == {}


def test_a_first_request_starts_from_the_card_then_from_what_was_measured():
    est = Estimates()
    est.card = {"greedy": 0.9, "mid": 0.3}
    policy = KPolicy(est, enabled=True, max_len=512)
    assert policy.new_acceptance("draft", False, "greedy").rate == pytest.approx(0.9)
    assert policy.new_acceptance("draft", False, "mid").rate == pytest.approx(0.3)
    for _ in range(50):                                          # the greedy band measures otherwise
        est.observe_acceptance("draft", 4, 0, 4, band="greedy")
    assert policy.new_acceptance("draft", False, "greedy").rate < 0.2
    assert policy.new_acceptance("draft", False, "mid").rate == pytest.approx(0.3)   # another band: untouched


def test_a_row_with_a_prediction_starts_from_the_prior_not_its_methods_card_or_history():
    from leaplm.engine.kpolicy.acceptance import AcceptanceEstimate

    est = Estimates()
    est.card = {"greedy": 0.1}
    policy = KPolicy(est, enabled=True, max_len=512)
    for _ in range(50):
        est.observe_acceptance("suffix", 4, 0, 4, band="greedy")
    assert policy.new_acceptance("suffix", True, "greedy").rate < 0.2
    predicted = policy.new_acceptance("suffix", True, "greedy", predicted=True)
    assert predicted.rate == pytest.approx(AcceptanceEstimate().rate) and predicted.bursty


def test_engines_of_one_scope_share_what_they_measured():
    """Two engines' estimates with the same (target, proposer) scope see each other's acceptance; another scope
    does not."""
    a, b, c = Estimates(), Estimates(), Estimates()
    a.method_acceptance = shared(("test-target", "test-draft"))
    b.method_acceptance = shared(("test-target", "test-draft"))
    c.method_acceptance = shared(("test-target", "other-draft"))
    for _ in range(30):
        a.observe_acceptance("draft", 4, 4, 4, band="greedy")
    assert KPolicy(b, True, 512).new_acceptance("draft", False, "greedy").rate > 0.9
    assert ("draft", "greedy") not in c.method_acceptance


@pytest.mark.parametrize("t,band", [(0.0, "greedy"), (0.3, "low"), (0.8, "mid"), (1.0, "mid"), (1.5, "high")])
def test_temperature_bands(t, band):
    assert temperature_band(t) == band


def test_structured_output_keeps_its_own_acceptance():
    """A constrained request starts from what constrained requests measured, not from the method's free text (nor
    its card, which measured free text); free text is not moved by constrained requests either."""
    est = Estimates()
    est.card = {"greedy": 0.9}
    policy = KPolicy(est, enabled=True, max_len=512)
    constrained = acceptance_band(0.0, constrained=True)
    assert constrained != "greedy" and acceptance_band(0.0) == "greedy"
    fresh = policy.new_acceptance("draft", False, constrained).rate
    assert fresh < 0.9
    for _ in range(50):
        est.observe_acceptance("draft", 4, 0, 4, band=constrained)
    assert policy.new_acceptance("draft", False, constrained).rate < 0.2
    assert policy.new_acceptance("draft", False, "greedy").rate == pytest.approx(0.9)

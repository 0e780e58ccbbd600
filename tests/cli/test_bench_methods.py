"""`leaplm bench --methods`: the first plain decoding is the baseline ("none") whatever options it names, so a
sampled comparison can pair every method with plain decoding under the same verifier."""
from __future__ import annotations

from leaplm.cli.bench import parse_methods


def test_a_first_none_with_options_is_the_baseline():
    cfgs = parse_methods("none:verifier=rejection,draft:verifier=rejection,none:verifier=race", 4)
    assert [label for label, _, _ in cfgs] == ["none", "draft k=4 verifier=rejection", "none verifier=race"]
    assert cfgs[0][2]["verifier"] == "rejection"


def test_without_none_a_plain_baseline_is_added():
    cfgs = parse_methods("ngram:k=8", 4)
    assert [(label, m) for label, m, _ in cfgs] == [("none", "none"), ("ngram k=8", "ngram")]
    assert "verifier" not in cfgs[0][2]

"""The ceiling of a prediction's speedup on a given output (bench/prediction_bound.py): the aligner's drafts
replayed over the output, the best block lengths in hindsight under a block-cost curve."""
from __future__ import annotations

import pytest

from leaplm.bench.prediction_bound import draft_runs, oracle_speedup, perfect_speedup

TEXT = ("the quick brown fox jumps over the lazy dog\n"
        "speculative decoding drafts tokens and the target verifies them\n")


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_an_output_that_is_its_prediction_is_drafted_to_the_end(byte_tokenizer):
    out = ids(byte_tokenizer, TEXT)
    right, lengths = draft_runs(byte_tokenizer, TEXT, out, k=8)
    assert right == [min(8, len(out) - j) for j in range(len(out))]
    assert lengths == right
    free = oracle_speedup(right, lengths, lambda T: 1.0)         # blocks cost one token: 9 tokens a forward
    assert free == pytest.approx(len(out) / -(-len(out) // 9))
    assert free == pytest.approx(perfect_speedup(len(out), lambda T: 1.0, k=8))
    assert oracle_speedup(right, lengths, lambda T: float(T)) == pytest.approx(1.0)   # linear cost: no gain


def test_an_unrelated_output_gains_nothing_and_an_edit_gains_less(byte_tokenizer):
    other = ids(byte_tokenizer, "0123456789 ~~~ nothing of the kind appears in that text ~~~\n")
    right, lengths = draft_runs(byte_tokenizer, TEXT, other, k=8)
    assert not any(right)
    assert oracle_speedup(right, lengths, lambda T: 1.0 + 0.25 * (T - 1)) == pytest.approx(1.0)
    edited = ids(byte_tokenizer, TEXT.replace("lazy", "sleepy"))
    right, lengths = draft_runs(byte_tokenizer, TEXT, edited, k=8)
    cost = lambda T: 1.0 + 0.25 * (T - 1)                                  # noqa: E731
    whole = perfect_speedup(len(edited), cost, k=8)
    assert 1.0 < oracle_speedup(right, lengths, cost) < whole
    assert right[-10] > 0                                  # realigned after the rename: the rest is drafted

"""The prediction proposer's alignment (propose/prediction.py) on a byte-level BPE tokenizer: it drafts the
prediction's next tokens while the output follows it, and finds its way back after an insertion, a deletion or a
rename (the occurrence ahead of the last aligned point first), and when the output's tokens split the text
elsewhere than the prediction's (drafting the re-tokenized rest of the word, then the prediction's own ids)."""
from __future__ import annotations

import pytest

from leaplm.config import ConfigError, SamplingParams, prediction_text
from leaplm.propose.prediction import Aligner, Prediction, check_prediction, prediction_ids

TEXT = ("the quick brown fox jumps over the lazy dog\n"
        "speculative decoding drafts tokens and the target verifies them\n"
        "def add(a, b):\n    return a + b\n")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def aligner(tok, text: str = TEXT) -> Aligner:
    return Aligner(Prediction.build(tok, ids(tok, text)), tok)


def after(tok, al: Aligner, output: str | list[int], k: int = 24) -> str:
    """The text of what `al` drafts once the output is `output` (text, tokenized alone, or token ids)."""
    out = ids(tok, output) if isinstance(output, str) else output
    al.sync(out)
    return tok.decode(al.draft(k))


def rest_of(text: str, upto: str) -> str:
    """TEXT after the first occurrence of `upto` (what a draft should continue with)."""
    return text[text.index(upto) + len(upto):]


def test_follows_the_prediction_on_its_own_ids(byte_tokenizer):
    tok = byte_tokenizer
    pred = ids(tok, TEXT)
    al = aligner(tok)
    assert al.draft(5) == pred[:5]                      # nothing generated yet: the prediction's start
    for n in (1, 7, 20):
        al.sync(pred[:n])
        assert al.draft(6) == pred[n: n + 6]
    assert al.match >= 10                               # a long agreement counts in tokens


def test_insertion_realigns_after_the_inserted_line(byte_tokenizer):
    tok = byte_tokenizer
    al = aligner(tok)
    out = "the quick brown fox jumps over the lazy dog\nan inserted line\nspeculative decoding"
    assert after(tok, al, out) == rest_of(TEXT, "speculative decoding")[: len(after(tok, al, out))]
    assert after(tok, al, out).startswith(" drafts tokens")


def test_deletion_realigns_ahead(byte_tokenizer):
    tok = byte_tokenizer
    al = aligner(tok)
    out = "the quick brown fox jumps over the lazy dog\ndef add(a, b)"    # the second line deleted
    assert after(tok, al, out).startswith(":\n    return a + b")


def test_rename_early_keeps_the_rest(byte_tokenizer):
    tok = byte_tokenizer
    al = aligner(tok)
    out = "the slow brown fox jumps"
    assert after(tok, al, out).startswith(" over the lazy dog\nspeculative")


def test_realigns_ahead_of_the_last_aligned_point_first(byte_tokenizer):
    """A line that occurs twice: after a departure in the second half, the occurrence ahead is followed."""
    tok = byte_tokenizer
    text = "the lazy dog and the quick fox\nspeculative decoding\nthe lazy dog and the target\n"
    al = aligner(tok, text)
    out = "the lazy dog and the quick fox\nspeculative tokens\nthe lazy dog and the"
    assert after(tok, al, out).startswith(" target")


def test_no_realignment_on_text_the_prediction_lacks(byte_tokenizer):
    tok = byte_tokenizer
    al = aligner(tok)
    assert after(tok, al, "größer über Straße, 東京") == ""
    assert al.match == 0


def test_token_boundary_shift_retokenizes_from_the_character(byte_tokenizer):
    """The output spells a word the prediction has as one token in single-byte tokens and stops inside it: the
    draft is the rest of that word tokenized afresh, then the prediction's own ids from its next boundary."""
    tok = byte_tokenizer
    pred = ids(tok, TEXT)
    # a token of the prediction that is one word of 4+ characters after a space, not at the start
    j = next(i for i, t in enumerate(pred) if i > 3 and tok.decode([t]).startswith(" ") and len(tok.decode([t])) >= 4)
    word = tok.decode([pred[j]])
    spelled = [ids(tok, ch)[0] for ch in word[:3]]     # the output's own split: one token per character
    assert spelled != pred[j: j + 3]
    al = aligner(tok)
    al.sync(pred[:j] + spelled)
    drafted = al.draft(24)
    upto = tok.decode(pred[:j]) + word[:3]
    assert tok.decode(drafted) == TEXT[len(upto):][: len(tok.decode(drafted))]
    assert len(tok.decode(drafted)) > 20
    frag = ids(tok, word[3:])                           # the rest of the word tokenized afresh ...
    assert drafted[: len(frag)] == frag
    assert drafted[len(frag): len(frag) + 3] == pred[j + 1: j + 4]   # ... then the prediction's own ids


def test_boundary_shift_inside_a_multibyte_character(byte_tokenizer):
    """Characters spanning several tokens: the output's text counts only complete characters."""
    tok = byte_tokenizer
    text = "un café crème, s'il vous plaît; naïve façade"
    al = aligner(tok, text)
    out = ids(tok, "un café crème, s'il vous pl")
    assert after(tok, al, out).startswith("aît; naïve")


def test_prediction_fields_are_checked():
    assert SamplingParams(prediction="").prediction is None              # empty is no prediction
    assert SamplingParams(prediction={"type": "content", "content": []}).prediction is None
    assert SamplingParams(prediction={"type": "content", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}
                          ).prediction == "ab"
    cases = [({"type": "file", "content": "x"}, "prediction.type"),
             ({"type": "content"}, "prediction.content"),
             ({"type": "content", "content": 3}, "prediction.content"),
             ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}, "prediction.content[0].type"),
             ({"type": "content", "content": ["x"]}, "prediction.content[0]"),
             ({"type": "content", "content": [{"type": "text", "text": 5}]}, "prediction.content[0].text"),
             ({"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
             (42, "prediction"),
             ("x" * (SamplingParams.MAX_PREDICTION_CHARS + 1), "prediction")]
    for value, field in cases:
        with pytest.raises(ConfigError) as e:
            prediction_text(value)
        assert e.value.field == field, (value, e.value.field)


def test_a_prediction_longer_than_the_context_is_refused(byte_tokenizer):
    n = len(prediction_ids(byte_tokenizer, TEXT))
    assert len(check_prediction(byte_tokenizer, TEXT, 10, 10 + n)) == n
    with pytest.raises(ConfigError) as e:
        check_prediction(byte_tokenizer, TEXT, 10, 10 + n - 1)
    assert e.value.field == "prediction"


def test_lines_wrapped_elsewhere_keep_the_alignment(byte_tokenizer):
    """An answer that wraps the prediction's lines at other places (a space for a newline, two spaces as one) is
    still following it: the draft after the re-wrapped text continues the prediction."""
    tok = byte_tokenizer
    text = "the quick brown fox\njumps over the  lazy dog and the target verifies them\n"
    al = aligner(tok, text)
    out = ids(tok, "the quick brown fox jumps over the lazy dog and")
    al.sync(out)
    assert al.c is not None                                 # never departed
    assert tok.decode(al.draft(8)).startswith(" the target")
    assert al.match >= 8


def test_reflowed_output_drafts_up_to_the_line_end(byte_tokenizer):
    """Once the output has spelt a line break of the prediction as a space, drafts stop at the prediction's next
    line break: the output chooses its own whitespace there."""
    tok = byte_tokenizer
    text = "the quick brown fox\njumps over the lazy dog\nand the target verifies them\n"
    al = aligner(tok, text)
    al.sync(ids(tok, "the quick brown fox jumps over"))
    assert al.reflow
    assert tok.decode(al.draft(24)) == " the lazy dog"

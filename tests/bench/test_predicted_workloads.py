"""The copy-heavy workloads: every prompt has a prediction, built from held-out standard-library text (never from
leaplm's own sources), and the `+prediction` spelling of `leaplm bench --methods` sends it."""
from __future__ import annotations

import pytest

from leaplm.bench.workloads import PREDICTED_WORKLOADS, get_workload
from leaplm.cli.bench import parse_methods
from leaplm.training.corpus import HELD_OUT_MODULES


@pytest.mark.parametrize("name", PREDICTED_WORKLOADS)
def test_each_prompt_has_its_prediction(name):
    w = get_workload(name, 4)
    assert len(w.prompts) == len(w.predictions) == 4
    assert all(isinstance(p, str) and len(p) > 100 for p in w.predictions)
    assert w.chat == (name != "complete")
    for prompt, pred in zip(w.prompts, w.predictions):
        text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        assert "leaplm" not in text
        if name in ("edit", "agent"):
            assert pred.strip("`\n").removeprefix("python\n").strip() in text     # the function, as shown
        if name == "proofread":
            assert pred in text                                                  # the text as given, typos too
    assert HELD_OUT_MODULES                          # the prompts come from these modules (training/corpus.py)


def test_proofread_texts_have_typos_to_correct():
    from leaplm.bench.workloads import _typos

    text = "The quick brownish foxes jumped over several sleeping dogs while nobody watched them carefully."
    assert _typos(text) != text and len(_typos(text)) == len(text)


def test_prediction_configurations_are_parsed():
    configs = parse_methods("none,none+prediction,suffix+prediction:k=8", 4)
    assert [c[0] for c in configs] == ["none", "none +prediction", "suffix k=8 +prediction"]
    assert [c[2].get("predicted", False) for c in configs] == [False, True, True]
    assert parse_methods("none+prediction", 4)[0][0] == "none"       # plain decoding stays the baseline


def test_serve_workloads_summary_pairs_each_request_with_none():
    """Decode rate = tokens after the first / first-to-last seconds; speedups paired by (round, prompt); a text that
    differs from none's is reported."""
    from leaplm.bench.serve_workloads import StreamResult, WorkloadSample, summarize

    def s(config, prompt, rnd, tokens, secs, text="same", acc=0, rej=0):
        return WorkloadSample("edit", config, prompt, rnd, StreamResult(text, tokens, 0.1, secs, acc, rej))

    rows = summarize([s("none", 0, 0, 101, 2.0), s("none +prediction", 0, 0, 101, 1.0, acc=80, rej=10),
                      s("none", 1, 0, 51, 1.0), s("none +prediction", 1, 0, 51, 0.25, text="other", acc=40)])
    none, pred = rows
    assert none["decode_tokens_per_s"] == 50.0 and none["identical_to_none"] is None
    assert pred["speedup_vs_none"] == 3.0                    # the median of 2x and 4x
    assert (pred["accepted_prediction_tokens"], pred["rejected_prediction_tokens"]) == (120, 10)
    assert pred["identical_to_none"] is False

"""Predicted Outputs through the real engine: greedy output with a prediction is token-identical to plain decoding
under every method (the prediction exact, edited, or unrelated; adaptive K on and off; batched rows beside rows
without one), beside structured output too; the usage counts add up; sampled output with a prediction follows the
target's distribution (Monte Carlo, the bound and enumeration of tests/engine/test_methods_lossless.py) and a
verifier that accepts every draft fails the same test."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from mc_bounds import tv_and_bound
from test_methods_lossless import accept_first_chain, exact_first_three, sample_first_three

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "heads"))
from head_helpers import random_head, train_tiny_eagle, write_word_corpus  # noqa: E402

NEW = 40
PROMPTS = [[1, 2, 3, 4, 5, 1, 2], [7, 3, 9, 3]]


@pytest.fixture(scope="module")
def target(tiny_llama_factory):
    return tiny_llama_factory(vocab=16, layers=2, seed=3)


@pytest.fixture(scope="module")
def methods(target, tiny_llama_factory, tmp_path_factory):
    """Every method's Engine options over the target (a draft model, an untrained EAGLE head, a Medusa head
    trained a few steps)."""
    d = tmp_path_factory.mktemp("prediction_heads")
    train_tiny_eagle(target.path, write_word_corpus(d / "c.jsonl", 16), d / "medusa", steps=4, kind="medusa",
                     medusa_heads=2, save_every=2, eval_every=2)
    return {
        "none": dict(method="none"),
        "draft": dict(method="draft", draft=tiny_llama_factory(vocab=16, layers=1, seed=5), k=4),
        "ngram": dict(method="ngram", k=4),
        "suffix": dict(method="suffix", k=6),
        "lookahead": dict(method="lookahead", k=6, window=3, ngram_size=3, guess_set=3),
        "layerskip": dict(method="layerskip", k=4, skip_layers=[1], skip_confidence=0.0),
        "eagle": dict(method="eagle", k=4, head=random_head(target, d / "eagle")),
        "medusa": dict(method="medusa", k=4, head=str(d / "medusa")),
    }


def greedy(prediction=None, new: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True, prediction=prediction)


def words(ids: list[int]) -> str:
    """The tiny tokenizer's text of ids (words t0..t15)."""
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture(scope="module")
def reference(target):
    eng = Engine(target, method="none")
    return {tuple(p): eng.generate(p, greedy()).token_ids for p in PROMPTS}


def predictions(ref: list[int]) -> dict[str, str]:
    """The output itself; the output with a token inserted, one deleted and one renamed; unrelated tokens."""
    edited = ref[:5] + [(ref[5] + 1) % 16] + ref[5:12] + ref[13:20] + [(ref[20] + 3) % 16] + ref[21:]
    return {"exact": words(ref), "edited": words(edited), "unrelated": words([(t * 7 + 3) % 16 for t in ref])}


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_k", "adaptive_k"])
@pytest.mark.parametrize("name", ["none", "draft", "ngram", "suffix", "lookahead", "layerskip", "eagle", "medusa"])
def test_greedy_with_a_prediction_equals_plain_decoding(name, adaptive, target, methods, reference):
    eng = Engine(target, adaptive_k=adaptive, **methods[name])
    for prompt in PROMPTS:
        ref = reference[tuple(prompt)]
        for kind, pred in predictions(ref).items():
            out = eng.generate(prompt, greedy(pred))
            assert out.token_ids == ref, (name, kind)
            s = out.stats
            assert s.accepted_prediction_tokens <= s.accepted_tokens
            assert s.accepted_prediction_tokens + s.rejected_prediction_tokens <= s.draft_tokens
            if kind == "exact" and not adaptive:     # the prediction drafted, and long blocks were kept
                assert s.accepted_prediction_tokens >= NEW // 2, (name, s)
                assert s.target_forwards <= NEW // 4, (name, s)
            if kind == "unrelated" and not adaptive:
                assert s.accepted_prediction_tokens < NEW // 4


def test_edits_realign(target, reference):
    """After an inserted, a deleted and a renamed token the prediction is followed again."""
    eng = Engine(target, method="none", adaptive_k=False)
    ref = reference[tuple(PROMPTS[0])]
    out = eng.generate(PROMPTS[0], greedy(predictions(ref)["edited"]))
    assert out.stats.accepted_prediction_tokens >= NEW - 10
    assert out.stats.rejected_prediction_tokens > 0


def test_empty_prediction_is_none(target, reference):
    eng = Engine(target, method="none")
    out = eng.generate(PROMPTS[0], greedy(""))
    assert out.token_ids == reference[tuple(PROMPTS[0])]
    assert out.stats.draft_tokens == 0 and out.stats.target_forwards == NEW


def test_batched_rows_with_and_without_a_prediction(target, methods, reference):
    """Rows of one batch, some with a prediction and some without, under a method drafting in a group."""
    eng = Engine(target, adaptive_k=False, **methods["draft"])
    ref = reference[tuple(PROMPTS[0])]
    preds = [predictions(ref)["exact"], None, predictions(ref)["edited"], None]
    outs = eng.generate_batch(PROMPTS[0], [greedy(p) for p in preds])
    for out, p in zip(outs, preds):
        assert out.token_ids == ref
        assert (out.stats.accepted_prediction_tokens > 0) == (p is not None)


def test_a_prediction_longer_than_the_context_is_refused(target):
    eng = Engine(target, method="none", max_model_len=64)
    with pytest.raises(ConfigError) as e:
        eng.generate(PROMPTS[0], greedy(words([1] * 60), new=8))
    assert e.value.field == "prediction"


# --- structured output beside a prediction -----------------------------------------------------------------------
def test_structured_output_with_a_prediction(loaded):
    from leaplm.config import StructuredOutput

    model = loaded("llama_tied")                   # a byte-level BPE tokenizer, which the grammar needs
    regex = StructuredOutput(regex="(the |quick |brown |fox )+dog")
    prompt = "the quick brown fox"
    plain = Engine(model, method="none").generate(prompt, SamplingParams(temperature=0, max_new_tokens=24,
                                                                         structured=regex))
    assert plain.token_ids
    for opts in (dict(method="none"), dict(method="suffix", k=6)):
        eng = Engine(model, adaptive_k=False, **opts)
        for pred in (plain.text, plain.text.replace("the", "fox", 1), "dog dog dog"):
            out = eng.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24, structured=regex,
                                                      prediction=pred))
            assert out.token_ids == plain.token_ids, (opts, pred)
            if pred == plain.text and len(plain.token_ids) > 4:
                assert out.stats.accepted_prediction_tokens + out.stats.forced_accepted > 0


# --- sampling: Monte Carlo against the exact target distribution ------------------------------------------------
N = 1500
N_CONTROL = 300
PROCESSED = dict(temperature=0.8, top_k=6, top_p=0.95, repetition_penalty=1.2)
MC = {                                            # name: (Engine options, sampling params)
    "none_race": (dict(method="none"), {}),
    "none_rejection": (dict(method="none"), dict(verifier="rejection")),
    "ngram_processed": (dict(method="ngram", k=3), PROCESSED),
}


@pytest.fixture(scope="module")
def mc_target(tiny_llama_factory):
    return tiny_llama_factory(vocab=8, layers=4, seed=2)


@pytest.fixture(scope="module")
def mc_case(mc_target):
    """A prompt and, as the prediction, the model's greedy continuation of it (so drafts are often accepted)."""
    prompt = [1, 2, 5, 1]
    g = Engine(mc_target, method="none").generate(prompt, greedy(new=6)).token_ids
    return prompt, words(g)


@pytest.mark.parametrize("name", MC)
def test_sampling_with_a_prediction_follows_the_target(name, mc_target, mc_case, ref_probs):
    options, params = MC[name]
    prompt, pred = mc_case
    exact = exact_first_three(mc_target.path, prompt, SamplingParams(**params), ref_probs)
    assert int((exact >= 1e-3).sum()) >= 8 and float(exact.max()) < 0.5        # a spread-out statistic
    got, accepted = sample_first_three(Engine(mc_target, adaptive_k=False, **options), prompt,
                                       dict(params, prediction=pred), N)
    assert accepted > N // 10                  # the prediction's drafts were accepted, often enough to matter
    tv, bound = tv_and_bound(got, exact, N)
    assert tv < bound, f"{name}: TV {tv:.4f} >= bound {bound:.4f}"


def test_negative_control_accept_every_prediction_token_fails(mc_target, mc_case, ref_probs, monkeypatch):
    """The same test with the race replaced by a verifier that keeps every draft must fail."""
    patched = 0
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("leaplm.engine") and hasattr(mod, "verify_coupled"):
            monkeypatch.setattr(mod, "verify_coupled", accept_first_chain)
            patched += 1
    assert patched >= 1
    prompt, pred = mc_case
    exact = exact_first_three(mc_target.path, prompt, SamplingParams(), ref_probs)
    got, _ = sample_first_three(Engine(mc_target, method="none", adaptive_k=False), prompt,
                                dict(prediction=pred), N_CONTROL)
    tv, bound = tv_and_bound(got, exact, N_CONTROL)
    assert tv > bound, f"the wrong verifier passed: TV {tv:.4f} <= bound {bound:.4f}"

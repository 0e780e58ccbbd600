"""Lossless sampling on the libllama backend (and, for a draft model and n-gram lookup, on leaplm's int8 kernel
over the same GGUF file), by Monte Carlo through the server's path (BatchScheduler over the one
step), for a draft model, n-gram lookup and two tree proposers (lookahead's fixed candidates, EAGLE's sampled
ones), under both sampled verifiers: the race (seeded requests) and rejection sampling (asked for by
SamplingParams.verifier, with a seed so the run is reproducible).

The statistic is tests/engine/test_lossless_sampling.py's: the joint distribution of generated positions 2 and 3
over N seeds, against the exact target distribution. The model is a tiny random Llama over a vocabulary of 8
tokens, exported to GGUF as Q8_0, on which llama.cpp's block and one-token kernels agree bit for bit (the
fixture asserts the start-up check, LlamaCppLM.batch_invariant), so the logits a prefix gets scored alone are the ones every speculative
block sees. The exact distribution is enumerated on the same backend: libllama's logits for each of the 1 + 8 + 64
prefixes, turned into p by transformers' own processors (conftest `reference_probs`), independently of leaplm's
sampling code.

The bound is mc_bounds.py's (Weissman et al. 2003, cells below 0.01 pooled, DELTA = 1e-6): a correct engine
exceeds it with probability below one in a million. Negative controls: the same check with the race replaced by a
verifier that keeps every draft, with rejection sampling recovering from p instead of the residual max(0, p - q),
and with the tree race keeping the first candidate whatever p says; each must exceed the bound.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models.gguf_export import export_gguf
from leaplm.models.llamacpp.binding import available
from leaplm.models.loading import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from gguf_writer import _root_conftest  # noqa: E402
from mc_bounds import tv_and_bound  # noqa: E402
from test_batch_distribution import sample_in_batches  # noqa: E402
from test_lossless_sampling import PROCESSED, always_accept, recover_from_p  # noqa: E402
from test_llamacpp import write_heads  # noqa: E402

pytestmark = pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")

N = 1200
WORDS = ["a", "b", "c", "d", "e", "f", "ab", "<|endoftext|>"]     # llama.cpp wants a merge: "a b" -> "ab"
PROMPT = [1, 2, 3, 1, 2]                     # repeats: n-gram lookup finds a continuation in it
METHODS = {                                  # name -> (Engine options, K)
    "draft": (lambda f: dict(method="draft", draft=f["draft"]), 3),
    "ngram": (lambda f: dict(method="ngram"), 3),
    "lookahead": (lambda f: dict(method="lookahead", window=3, ngram_size=3, guess_set=3), 4),
    "eagle": (lambda f: dict(method="eagle", head=f["heads"]["eagle"]), 4),
}


def write_word_tokenizer(path):
    """A byte-level BPE over WORDS alone (GGUF's gpt2 tokenizer type, which llama.cpp and transformers both read)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE({w: i for i, w in enumerate(WORDS)}, [("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=WORDS[-1])
    fast.save_pretrained(str(path))
    return fast


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    """{"target": the Q8_0 target loaded on libllama, "draft": a Q8_0 GGUF of an unrelated random 1-layer model
    over the same words (about half its drafts kept here), "heads": {"eagle": an untrained head for the
    target}}."""
    root = _root_conftest()
    d = tmp_path_factory.mktemp("llamacpp_mc")
    tok = write_word_tokenizer(d / "tok")
    target = root.write_family_checkpoint(d / "target", "llama_tied", tok)
    draft = root.write_family_checkpoint(d / "draft", "llama_draft", tok)
    files = {name: str(export_gguf(src, str(d / f"{name}-q8_0.gguf"), "q8_0").path)
             for name, src in (("target", target), ("draft", draft))}
    lm = load_model(files["target"], backend="llamacpp")
    assert lm.backend == "llamacpp" and lm.model.batch_invariant
    return {"target": lm, "draft": files["draft"], "heads": write_heads(lm, d / "heads"), "file": files["target"]}


@pytest.fixture(scope="module")
def q8_kernel(q8):
    """The same Q8_0 target file on leaplm's int8 kernel (the default backend for a GGUF file), same draft."""
    lm = load_model(q8["file"], backend="torch", quantization="gguf")
    return dict(q8, target=lm, backend="torch")


def exact_positions_2_3(lm, params: SamplingParams, reference_probs) -> torch.Tensor:
    """P(y2 = a, y3 = b) [V, V] = sum over y1 of p(y1) p(y2 | y1) p(y3 | y1, y2), each p from libllama's logits
    of the prefix, scored alone in a fresh cache (prefixes p gives no mass are skipped)."""
    V = lm.model.vocab_size

    def p_next(prefix: tuple) -> torch.Tensor:                                    # [V]
        ids = PROMPT + list(prefix)
        cache = lm.model.new_cache(1, 64)
        logits = lm.model(torch.tensor([ids]), cache, last_only=True)[0, -1:]     # [1, V]
        return reference_probs(logits, [ids], params)[0].double()

    joint = torch.zeros(V, V, dtype=torch.float64)
    p1 = p_next(())
    for a in p1.nonzero().flatten().tolist():
        p2 = p_next((a,))
        for b in p2.nonzero().flatten().tolist():
            joint[b] += p1[a] * p2[b] * p_next((a, b))
    assert abs(float(joint.sum()) - 1) < 1e-6
    assert int((joint >= 0.01).sum()) >= 6 and float(joint.max()) < 0.6       # a distribution worth testing
    return joint


@dataclass
class MonteCarlo:
    tv: float                        # between the empirical and the exact joint of positions 2 and 3
    bound: float                     # what a correct sampler exceeds with probability below DELTA
    drafted: int
    accepted: int


def run(q8, method: str, verifier: str, ref_probs, params: dict = PROCESSED) -> MonteCarlo:
    """N seeded rows of `method` under `verifier`, K fixed, against the exact distribution."""
    options, k = METHODS[method]
    eng = Engine(q8["target"], k=k, adaptive_k=False, **options(q8))
    assert eng.backend == q8.get("backend", "llamacpp") and eng.exactness == "identical"
    exact = exact_positions_2_3(q8["target"], SamplingParams(**params), ref_probs)
    tally: dict[str, int] = {}
    got = sample_in_batches(eng, dict(params, verifier=verifier), n=N, kinds=[(method, k)], prompt=PROMPT,
                            tally=tally)
    return MonteCarlo(*tv_and_bound(got, exact, N), tally["drafted"], tally["accepted"])


@pytest.mark.parametrize("verifier", ["race", "rejection"])
@pytest.mark.parametrize("method", list(METHODS))
def test_positions_2_and_3_follow_the_target_on_libllama(method, verifier, q8, ref_probs):
    mc = run(q8, method, verifier, ref_probs)
    # drafts both kept and rejected, dozens of times at least (lookahead keeps the fewest, about 2%): accepted,
    # recovered and bonus tokens all reach the statistic
    assert mc.accepted >= 50 and mc.drafted - mc.accepted >= 50, mc
    assert mc.tv < mc.bound, f"TV {mc.tv:.4f} >= bound {mc.bound:.4f} ({method}, {verifier})"


@pytest.mark.parametrize("verifier", ["race", "rejection"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_positions_2_and_3_follow_the_target_on_the_int8_kernel(method, verifier, q8_kernel, ref_probs):
    mc = run(q8_kernel, method, verifier, ref_probs)
    assert mc.accepted >= 50 and mc.drafted - mc.accepted >= 50, mc
    assert mc.tv < mc.bound, f"TV {mc.tv:.4f} >= bound {mc.bound:.4f} ({method}, {verifier}, int8 kernel)"


def test_negative_control_on_the_int8_kernel_the_race_keeping_every_draft_fails(q8_kernel, ref_probs,
                                                                               monkeypatch):
    patch_everywhere(monkeypatch, "verify_coupled", always_accept)
    always_accept.calls = 0
    mc = run(q8_kernel, "draft", "race", ref_probs)
    assert always_accept.calls >= N
    assert mc.tv > mc.bound, f"the wrong verifier passed: TV {mc.tv:.4f} < bound {mc.bound:.4f}"


def patch_everywhere(monkeypatch, name: str, fake) -> None:
    """Replace verifier `name` wherever the engine looks it up."""
    patched = [m for mod, m in list(sys.modules.items()) if mod.startswith("leaplm.engine") and hasattr(m, name)]
    assert patched
    for m in patched:
        monkeypatch.setattr(m, name, fake)


def test_negative_control_the_race_keeping_every_draft_fails(q8, ref_probs, monkeypatch):
    patch_everywhere(monkeypatch, "verify_coupled", always_accept)
    always_accept.calls = 0
    mc = run(q8, "draft", "race", ref_probs)
    assert always_accept.calls >= N                                # the wrong verifier really ran
    assert mc.tv > mc.bound, f"the wrong verifier passed: TV {mc.tv:.4f} < bound {mc.bound:.4f}"


def test_negative_control_rejection_recovering_from_p_fails(q8, ref_probs, monkeypatch):
    patch_everywhere(monkeypatch, "verify_rejection", recover_from_p)
    recover_from_p.calls = 0
    mc = run(q8, "draft", "rejection", ref_probs)
    assert recover_from_p.calls >= N
    assert mc.tv > mc.bound, f"the wrong verifier passed: TV {mc.tv:.4f} < bound {mc.bound:.4f}"


def keeps_first_candidate(nodes, parents, p, seed, base):
    """A wrong tree race: the root's first child is always kept, the rest verified as the race would."""
    from leaplm.sampling.positional import race
    from leaplm.verify import verify_tree_greedy

    keeps_first_candidate.calls += 1
    depth: list[int] = []
    for par in parents:
        depth.append(1 if par < 0 else depth[par] + 1)
    target = race(p, seed, [base] + [base + d for d in depth]).clone()        # [K + 1] the target's own samples
    target[0] = nodes[0]
    return verify_tree_greedy(nodes, parents, target)


def test_negative_control_the_tree_race_keeping_a_candidate_fails(q8, ref_probs, monkeypatch):
    patch_everywhere(monkeypatch, "verify_tree_coupled", keeps_first_candidate)
    keeps_first_candidate.calls = 0
    mc = run(q8, "eagle", "race", ref_probs)
    assert keeps_first_candidate.calls >= N
    assert mc.tv > mc.bound, f"the wrong verifier passed: TV {mc.tv:.4f} < bound {mc.bound:.4f}"

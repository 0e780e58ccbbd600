"""The draft-free methods (ngram, suffix, lookahead, layerskip) and tree verification through the real engine.

Greedy: token-identical to method 'none', on several model families (a sliding window shorter than the
sequence included), with and without a repetition penalty, with the adaptive K controller on and off, and
near the end of the context. Oracle proposers plant trees of several shapes that contain the right branch to
a random depth, or only wrong tokens (nothing accepted), or nothing at all (K = 0 proposals).

Sampling: Monte Carlo on an 8-token vocabulary, from a prompt that repeats the model's own greedy
continuation (so every method finds matches and gets tokens accepted, not only rejected). Statistic: the
joint distribution of the first three generated tokens, against the exact target distribution enumerated
through transformers' model and processors (independent of leaplm's model and sampling code). Bound, as in
tests/engine/test_lossless_sampling.py: cells of the exact distribution with probability >= MIN_CELL kept,
the rest merged, fixed before sampling (k cells); Weissman et al. (2003) give
P(TV >= t) <= 2^k exp(-2 N t^2) = DELTA, so t = sqrt((k ln 2 + ln(1 / DELTA)) / 2N). Seeds are fixed, so
the outcome is too. Negative control: the same test with the engine's verifiers replaced by ones that
accept the first candidate must exceed it.
"""
from __future__ import annotations

import itertools
import math
import random
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from leaplm.cache.tree import children
from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.propose import registry
from leaplm.propose.base import Proposal, ProposerBase
from leaplm.sampling.positional import race
from leaplm.verify import VerifyResult
from mc_bounds import DELTA, MIN_CELL, tv_and_bound  # noqa: F401  (shared bound, see its docstring)

NEW = 40
LOOP = [1, 2, 3, 4, 5] * 3                      # a repetitive prompt: the draft-free methods find matches in it
PROMPTS = [LOOP, [7, 3, 9, 3, 7, 1], [4]]

METHODS = {                                      # name: Engine options
    "ngram": dict(method="ngram", k=4),
    "ngram_long": dict(method="ngram", k=8, ngram_min=2, ngram_max=3),
    "suffix": dict(method="suffix", k=6),
    "suffix_big": dict(method="suffix", k=16, ngram_min=1, ngram_max=6),
    "lookahead": dict(method="lookahead", k=6, window=3, ngram_size=3, guess_set=3),
    "lookahead_n2": dict(method="lookahead", k=4, window=4, ngram_size=2, guess_set=4),
    "layerskip_auto": dict(method="layerskip", k=4),
    "layerskip_fixed": dict(method="layerskip", k=5, skip_layers=[1, 2], skip_confidence=0.0),
}


def greedy(max_new: int = NEW, penalty: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True, repetition_penalty=penalty)


@pytest.fixture(scope="module")
def target(tiny_llama_factory):
    """Vocabulary 16, 4 layers (layerskip has middle layers to choose from)."""
    return tiny_llama_factory(vocab=16, layers=4, seed=3)


@pytest.fixture(scope="module")
def reference():
    memo = {}

    def get(model, prompt, params: SamplingParams, max_model_len=None) -> list[int]:
        key = (id(model), tuple(prompt), params.max_new_tokens, params.repetition_penalty, max_model_len)
        if key not in memo:
            memo[key] = Engine(model, method="none", max_model_len=max_model_len).generate(prompt, params).token_ids
        return memo[key]

    return get


# --- greedy: every method equals plain decoding ------------------------------------------------------------------
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_k", "adaptive_k"])
@pytest.mark.parametrize("name", METHODS)
def test_greedy_equals_none(name, adaptive, target, reference):
    eng = Engine(target, adaptive_k=adaptive, **METHODS[name])
    drafted = accepted = 0
    for prompt in PROMPTS + PROMPTS[:1]:         # the repeat: suffix also draws on the earlier requests
        out = eng.generate(prompt, greedy())
        assert out.token_ids == reference(target, prompt, greedy())
        drafted += out.stats.draft_tokens
        accepted += out.stats.accepted_tokens
    if not adaptive:                             # the regime claimed was exercised: proposals, some accepted
        assert drafted > 0 and accepted > 0, (drafted, accepted)


@pytest.mark.parametrize("name", ["ngram", "suffix", "lookahead", "layerskip_fixed"])
def test_greedy_with_repetition_penalty(name, target, reference):
    """Tree rows count the tokens of their own branch only (sampling/processors.tree_presence)."""
    eng = Engine(target, adaptive_k=False, **METHODS[name])
    for prompt in PROMPTS:
        assert eng.generate(prompt, greedy(penalty=1.5)).token_ids == reference(target, prompt, greedy(penalty=1.5))
    assert reference(target, LOOP, greedy(penalty=1.5)) != reference(target, LOOP, greedy())   # the penalty acts


@pytest.mark.parametrize("family", ["mistral_sw", "qwen3_qknorm", "llama3_rope"])
@pytest.mark.parametrize("name", ["ngram", "suffix", "lookahead", "layerskip_fixed"])
def test_greedy_on_other_families(family, name, loaded, reference):
    """mistral_sw has a sliding window of 8, shorter than the sequence: tree and window rows must respect it."""
    model = loaded(family)
    opts = dict(METHODS[name])
    if name == "layerskip_fixed":
        opts["skip_layers"] = [1]                 # these checkpoints have 2 layers
    eng = Engine(model, adaptive_k=False, **opts)
    for prompt in ["the quick brown fox the quick brown fox the quick", "def add(a, b):"]:
        ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert eng.generate(ids, greedy(30)).token_ids == reference(model, ids, greedy(30))


@pytest.mark.parametrize("name", METHODS)
def test_greedy_up_to_the_end_of_the_context(name, target, reference):
    """max_model_len leaves no room at the end: K shrinks to the room left, lookahead drops its window."""
    eng = Engine(target, adaptive_k=False, max_model_len=40, **METHODS[name])
    params = greedy(max_new=40 - len(LOOP))
    assert eng.generate(LOOP, params).token_ids == reference(target, LOOP, params, max_model_len=40)


@pytest.mark.parametrize("name", ["suffix", "lookahead", "layerskip_fixed"])
def test_logprobs_equal_plain_decoding(name, target):
    """Logprobs come from the rows of the accepted path (tree rows compacted, window rows ignored)."""
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, logprobs=2)
    plain = Engine(target, method="none").generate(LOOP, params).logprobs
    spec = Engine(target, adaptive_k=False, **METHODS[name]).generate(LOOP, params).logprobs
    assert [lp.token_id for lp in spec] == [lp.token_id for lp in plain]
    for a, b in zip(spec, plain):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


# --- oracle proposers: trees of several shapes, nothing accepted, nothing proposed ------------------------------
class OracleTree(ProposerBase):
    """Plants the correct greedy continuation (known from a reference run) to a random depth in a tree of the
    given shape; every other node, and with `wrong` every node, carries a token that is not the continuation."""
    name = "oracle"
    samples = False

    def __init__(self, reference: list[int], shape, wrong: bool, seed: int, vocab: int):
        self.ref, self.shape, self.wrong, self.vocab = reference, shape, wrong, vocab
        self.rng = random.Random(seed)

    def propose(self, ctx) -> Proposal:
        parents = self.shape(self.rng, ctx.k) if callable(self.shape) else self.shape[: ctx.k]
        parents = [p if p < i else -1 for i, p in enumerate(parents)]
        at = len(ctx.tokens)
        depth = [0] * len(parents)
        for i, p in enumerate(parents):
            depth[i] = (depth[p] if p >= 0 else 0) + 1
        kids = children(parents)
        planted: set[int] = set()
        if not self.wrong:                         # one root-to-node branch carries the truth
            row = 0
            while kids[row] and self.rng.random() < 0.8:
                c = self.rng.choice(kids[row])
                planted.add(c)
                row = c + 1
        tokens = []
        for i in range(len(parents)):
            truth = self.ref[at + depth[i] - 1] if at + depth[i] - 1 < len(self.ref) else 0
            tokens.append(truth if i in planted else (truth + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab)
        return Proposal(torch.tensor(tokens, dtype=torch.long), parents=parents)

    def observe(self, proposal, result, extra_logits=None) -> None:
        pass


def random_shape(rng: random.Random, k: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(rng.randrange(0, k + 1))]


SHAPES = {
    "chain": [-1, 0, 1, 2, 3, 4],
    "star": [-1, -1, -1, -1],
    "binary": [-1, -1, 0, 0, 1, 1, 2, 2],
    "mixed": [-1, 0, 0, -1, 3, 1, 5, 5, 2],
    "random": random_shape,
    "empty": [],
}


@pytest.fixture
def oracle_method(monkeypatch):
    """install(make) routes method 'ngram' to a proposer built by make(max_len)."""
    registry._load_builtin()                        # so the real modules' @register cannot overwrite ours later

    def install(make):
        monkeypatch.setitem(registry.BUILDERS, "ngram", lambda spec, target, draft: make)

    return install


@pytest.mark.parametrize("wrong", [False, True], ids=["planted", "all_wrong"])
@pytest.mark.parametrize("shape", SHAPES)
def test_oracle_trees_equal_none(shape, wrong, target, reference, oracle_method):
    V = target.model.vocab_size
    for prompt in PROMPTS:
        ref = prompt + reference(target, prompt, greedy())
        oracle_method(lambda max_len: OracleTree(ref, SHAPES[shape], wrong, seed=len(prompt), vocab=V))
        out = Engine(target, method="ngram", k=9, adaptive_k=False).generate(prompt, greedy())
        assert out.token_ids == ref[len(prompt):]
        if wrong or shape == "empty":
            assert out.stats.accepted_tokens == 0 and out.stats.target_forwards == NEW
        elif shape != "random":
            assert out.stats.accepted_tokens > 0


def test_empty_chain_proposals_are_plain_decoding(target, reference, oracle_method):
    """A proposer with nothing to say returns 0 tokens (parents None: the chain path with no drafts)."""
    class Silent(ProposerBase):
        name, samples = "silent", False

        def propose(self, ctx):
            return Proposal(torch.empty(0, dtype=torch.long))

        def observe(self, proposal, result, extra_logits=None):
            pass

    oracle_method(lambda max_len: Silent())
    eng = Engine(target, method="ngram", k=3, adaptive_k=False)
    out = eng.generate(LOOP, greedy())
    assert out.token_ids == reference(target, LOOP, greedy())
    assert out.stats.draft_tokens == 0 and out.stats.target_forwards == NEW
    sampled = eng.generate(LOOP, SamplingParams(temperature=1.0, max_new_tokens=5, seed=0))
    assert sampled.token_ids == Engine(target, method="none").generate(LOOP, SamplingParams(
        temperature=1.0, max_new_tokens=5, seed=0)).token_ids   # same draws as plain decoding


# --- configuration at the boundary -------------------------------------------------------------------------------
def test_spec_options_reach_the_proposer(target):
    eng = Engine(target, method="ngram", k=7, ngram_min=2, ngram_max=3)
    assert (eng.spec.k, eng.spec.ngram_min, eng.spec.ngram_max) == (7, 2, 3)


@pytest.mark.parametrize("options, field", [
    (dict(method="ngram", ngram_min=3, ngram_max=2), "ngram_max"),
    (dict(method="lookahead", ngram_size=1), "ngram_size"),
    (dict(method="lookahead", window=0), "window"),
    (dict(method="layerskip", skip_layers=[9]), "skip_layers"),
    (dict(method="layerskip", skip_layers=[0, 1, 2, 3]), "skip_layers"),
    (dict(method="layerskip", skip_layers=[]), "skip_layers"),
    (dict(method="layerskip", skip_confidence=1.5), "skip_confidence"),
    (dict(method="suffix", corpus="/no/such/corpus"), "corpus"),
])
def test_bad_options_name_the_field(options, field, target):
    with pytest.raises(ConfigError) as e:
        Engine(target, **options)
    assert e.value.field == field


@pytest.mark.parametrize("method", ["suffix", "lookahead", "layerskip"])
def test_methods_needing_a_native_model_refuse_the_fallback(method, loaded):
    with pytest.raises(ConfigError) as e:
        Engine(loaded("gpt2"), method=method)
    assert e.value.field == "method"


def test_layerskip_needs_layers_to_choose_from(loaded):
    with pytest.raises(ConfigError, match="skip-layers"):
        Engine(loaded("llama_tied"), method="layerskip")     # 2 layers: no middle layer to skip


# --- sampling: Monte Carlo against the exact target distribution ------------------------------------------------
N = 1500
N_CONTROL = 300
PROCESSED = dict(temperature=0.8, top_k=6, top_p=0.95, repetition_penalty=1.2)
MC_METHODS = {                                              # name: (Engine options, sampling params)
    "ngram": (dict(method="ngram", k=3), {}),
    "suffix": (dict(method="suffix", k=4), PROCESSED),
    "lookahead": (dict(method="lookahead", k=3, window=3, ngram_size=2, guess_set=3), {}),
    "layerskip": (dict(method="layerskip", k=3, skip_layers=[1, 2], skip_confidence=0.0), PROCESSED),
}


@pytest.fixture(scope="module")
def mc_target(tiny_llama_factory):
    return tiny_llama_factory(vocab=8, layers=4, seed=2)


@pytest.fixture(scope="module")
def mc_prompt(mc_target):
    """[1, 2], its 10-token greedy continuation g, then [1, 2] + g[:2] again: what follows is likely g[2:]."""
    g = Engine(mc_target, method="none").generate([1, 2], greedy(10)).token_ids
    return [1, 2] + g + [1, 2] + g[:2]


def exact_first_three(path: str, prompt: list[int], params: SamplingParams, reference_probs) -> torch.Tensor:
    """P(y1, y2, y3) [V, V, V] by enumeration through transformers (model and processors)."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    V = model.config.vocab_size

    def next_probs(prefixes: list[tuple]) -> torch.Tensor:                    # [len(prefixes), V]
        ctx = [prompt + list(pre) for pre in prefixes]
        with torch.no_grad():
            logits = model(torch.tensor(ctx)).logits[:, -1]
        return reference_probs(logits, ctx, params).double()

    p1 = next_probs([()])[0]                                                  # [V]
    p2 = next_probs([(a,) for a in range(V)])                                 # [V, V]
    p3 = next_probs(list(itertools.product(range(V), repeat=2))).view(V, V, V)
    joint = p1.view(V, 1, 1) * p2.view(V, V, 1) * p3
    assert abs(float(joint.sum()) - 1) < 1e-6
    return joint


def sample_first_three(engine: Engine, prompt: list[int], params: dict, n: int) -> tuple[torch.Tensor, int]:
    """Empirical joint [V, V, V] over seeds 0..n-1, and how many draft tokens were accepted."""
    V = engine.model.vocab_size
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    accepted = 0
    for seed in range(n):
        out = engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=seed, **params))
        counts[tuple(out.token_ids)] += 1
        accepted += out.stats.accepted_tokens
    return counts / n, accepted


@pytest.mark.parametrize("name", MC_METHODS)
def test_sampling_follows_the_target(name, mc_target, mc_prompt, ref_probs):
    options, params = MC_METHODS[name]
    exact = exact_first_three(mc_target.path, mc_prompt, SamplingParams(**params), ref_probs)
    assert int((exact >= MIN_CELL).sum()) >= 8 and float(exact.max()) < 0.5     # a spread-out statistic
    got, accepted = sample_first_three(Engine(mc_target, adaptive_k=False, **options), mc_prompt, params, N)
    assert accepted > N // 10                  # speculation really happened, often enough to matter
    tv, bound = tv_and_bound(got, exact, N)
    assert tv < bound, f"{name}: TV {tv:.4f} >= bound {bound:.4f}"


def accept_first_chain(draft, p, seed, base) -> VerifyResult:
    """Wrong on purpose: keeps every draft token, then the target's sample after them."""
    K = draft.numel()
    bonus = int(race(p[K:], seed, [base + K])[0])
    return VerifyResult(draft.tolist() + [bonus], K)


def accept_first_tree(nodes, parents, p, seed, base) -> VerifyResult:
    """Wrong on purpose: follows the first child down to a leaf, then the target's sample there."""
    toks, kids = nodes.tolist(), children(parents)
    path, row = [], 0
    while kids[row]:
        path.append(kids[row][0])
        row = kids[row][0] + 1
    bonus = int(race(p[row: row + 1], seed, [base + len(path)])[0])
    return VerifyResult([toks[c] for c in path] + [bonus], len(path), path)


@pytest.mark.parametrize("name", MC_METHODS)
def test_negative_control_accept_first_fails_the_bound(name, mc_target, mc_prompt, ref_probs, monkeypatch):
    """The same test with the verifiers replaced wherever the engine looks them up must fail."""
    swaps = {"verify_coupled": accept_first_chain, "verify_tree_coupled": accept_first_tree}
    patched = 0
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("leaplm.engine"):
            for attr, wrong in swaps.items():
                if hasattr(mod, attr):
                    monkeypatch.setattr(mod, attr, wrong)
                    patched += 1
    assert patched >= 2
    options, params = MC_METHODS[name]
    exact = exact_first_three(mc_target.path, mc_prompt, SamplingParams(**params), ref_probs)
    got, _ = sample_first_three(Engine(mc_target, adaptive_k=False, **options), mc_prompt, params, N_CONTROL)
    tv, bound = tv_and_bound(got, exact, N_CONTROL)
    assert tv > bound, f"{name}: the wrong verifier passed: TV {tv:.4f} <= bound {bound:.4f}"

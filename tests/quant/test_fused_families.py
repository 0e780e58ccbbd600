"""The C++ layer loop (quant/fused.py) for the families whose options it implements beyond Llama's: per-head q/k
norms (a tiny random qwen3) and GELU-tanh (a tiny random Llama with hidden_act gelu_pytorch_tanh). As test_fused.py
checks for SiLU: close to the model's PyTorch layer loop over the same quantized linears, a token's logits
bit-identical in any block, and greedy output of speculative methods (verifying blocks of drafted tokens)
token-identical to plain decoding."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.kernels.build import unavailable_reason
from leaplm.models import load_model
from leaplm.quant import fused
from leaplm.quant.fused import LayerOptions, build_fused, why_not_fused

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"C++ extension cannot be built here: {unavailable_reason()}")

FAMILIES = ["qwen3_qknorm", "llama_gelu"]


@dataclass
class Case:
    family: str                  # a tests/conftest.py FAMILIES name
    quant: str                   # --quantization
    lm: object                   # the LoadedModel


@pytest.fixture(scope="module", params=[(f, q) for f in FAMILIES for q in ("int8", "int4")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, checkpoint):
    family, quant = request.param
    lm = load_model(checkpoint(family), quantization=quant)
    m = lm.model
    assert m.args.qk_norm == (family == "qwen3_qknorm")
    assert m.args.hidden_act == ("gelu_pytorch_tanh" if family == "llama_gelu" else "silu")
    assert why_not_fused(m) is None and m.fused_layers() is not None
    return Case(family, quant, lm)


IDS = [3, 17, 5, 9, 22, 1, 30, 8, 8, 14, 2, 39]


def logits(m, ids, fused_loop=True, **kw):
    m.layer_weights()
    saved = m._fused
    if not fused_loop:
        m._fused = None
    try:
        return m(torch.tensor([ids]), m.new_cache(1, 64), **kw)[0]
    finally:
        m._fused = saved


def test_close_to_the_pytorch_layer_loop(case):
    m = case.lm.model
    a, b = logits(m, IDS), logits(m, IDS, fused_loop=False)
    scale = b.abs().max().item()
    # the same quantized linears; norms, rope, attention and the activation rounded in another order: fp32 rounding
    # (~1e-7 of the logits' range), except where an activation's int8 rounding tips (a value within rounding error
    # of a half step goes the other way in one loop): one activation moves by one int8 step (1/127 of its block's
    # largest) and the positions after it move with it. The bound is one int8 step of the logits' range: a tip on
    # an AVX2 machine moved one position of qwen3_qknorm int4 by 0.0023 of it; the negative controls are 0.12-0.93
    assert torch.allclose(a, b, rtol=0, atol=scale / 127), ((a - b).abs().max() / scale).item()


def test_negative_control_the_loop_without_the_familys_option_is_far_off(case, monkeypatch):
    """The loop built without the family's option (q/k norms dropped; SiLU in place of GELU-tanh) misses the bound
    the test above holds: the option is what brings the loop to the PyTorch loop."""
    m = case.lm.model
    real = fused.decoder_options

    def without(model):
        o = real(model)
        if model.args.qk_norm:
            o.layers = [LayerOptions() for _ in o.layers]
        else:
            o.act = "silu"
        return o

    monkeypatch.setattr(fused, "decoder_options", without)
    saved = m._fused
    try:
        m._fused = build_fused(m)
        a = logits(m, IDS)
    finally:
        m._fused = saved
    b = logits(m, IDS, fused_loop=False)
    assert not torch.allclose(a, b, rtol=0, atol=b.abs().max().item() / 127)


def test_a_token_is_bit_identical_in_any_block(case):
    m = case.lm.model
    full = logits(m, IDS)
    cache = m.new_cache(1, 64)
    step = []
    for t in IDS:                                                    # one token at a time (plain decoding)
        step.append(m(torch.tensor([[t]]), cache)[0, 0])
        cache.advance(1)
    assert torch.equal(torch.stack(step), full)
    cache = m.new_cache(1, 64)                                       # a prefix, then blocks of 5 and 4
    m(torch.tensor([IDS[:3]]), cache)
    cache.advance(3)
    assert torch.equal(m(torch.tensor([IDS[3:8]]), cache)[0], full[3:8])
    cache.advance(5)
    assert torch.equal(m(torch.tensor([IDS[8:]]), cache)[0], full[8:])


def test_tree_node_equals_its_chain(case):
    m = case.lm.model
    prefix, a, b, c = IDS[:6], 7, 11, 13
    cache = m.new_cache(1, 64)
    m(torch.tensor([prefix]), cache)
    cache.advance(len(prefix))
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = m(torch.tensor([[a, b, c]]), cache, tree_mask=mask, position_offsets=torch.tensor([0, 1, 1]))[0]
    assert torch.equal(tree[:2], logits(m, prefix + [a, b])[6:])
    assert torch.equal(tree[2], logits(m, prefix + [a, c])[7])


def test_every_path_gives_the_same_bits(case):
    m = case.lm.model
    ext = next(iter(m.quantized.values())).parts[0].ext
    ids = IDS * 3                                                    # 36 tokens: linears of 32 and 4 rows
    fast = logits(m, ids)
    chosen = ext.path
    try:
        ext.path = 0
        m._fused = build_fused(m)
        slow = logits(m, ids)
    finally:
        ext.path = chosen
        m._fused = False
    assert torch.equal(slow, fast)


LOOP = [40, 41, 42, 43, 44] * 3
PROMPTS = [LOOP, [70, 33, 90, 33, 70, 10], [44]]
METHODS = {
    "ngram": dict(method="ngram", k=4),
    "suffix": dict(method="suffix", k=6),
    "lookahead": dict(method="lookahead", k=6, window=3, ngram_size=3, guess_set=3),
    "layerskip": dict(method="layerskip", k=5, skip_layers=[1], skip_confidence=0.0),
    "draft": dict(method="draft", k=4),
}
GREEDY = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("name", METHODS)
def test_greedy_every_method_equals_none(name, case, checkpoint):
    """test_quantized_model.py's check for these families: drafted tokens verified in blocks through the loop give
    the tokens of plain decoding. The draft method's draft is a second copy of the target, so every drafted token
    is accepted and every row of each verified block is used; the other methods' drafts are mostly rejected on a
    random model (the block's first row is still used)."""
    plain = Engine(case.lm, method="none")
    draft = load_model(checkpoint(case.family), quantization=case.quant) if name == "draft" else None
    eng = Engine(case.lm, draft=draft, adaptive_k=False, **METHODS[name])
    drafted = accepted = 0
    for prompt in PROMPTS:
        out = eng.generate(prompt, GREEDY)
        assert out.token_ids == plain.generate(prompt, GREEDY).token_ids, (name, prompt)
        drafted, accepted = drafted + out.stats.draft_tokens, accepted + out.stats.accepted_tokens
    assert drafted > 0, drafted                                      # speculation really ran
    if name == "draft":
        assert accepted == drafted, (drafted, accepted)


"""A draft's whole forward in one C++ call (models/one_call.py): close to the PyTorch forward of the same weights,
a token's logits bit-identical whatever the block or batch it is computed in, bf16-held weights the same bits as
their fp32 values, given to drafts only, and greedy speculation through it token-identical to plain decoding."""
from __future__ import annotations

import pytest
import torch

from leaplm.kernels.build import unavailable_reason
from leaplm.models import load_model
from leaplm.models.one_call import kept, why_not_one_call

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"C++ extension cannot be built here: {unavailable_reason()}")


def write_tiny_llama(*args, **kw):
    """tests/conftest.py's writer, by path (as tests/quant/test_fused.py loads it)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "leaplm_tests_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "conftest.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name].write_tiny_llama(*args, **kw)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    # hidden 48: not a multiple of 32 (the quantized layer loop's), as draft-1m's 112 is not
    return write_tiny_llama(tmp_path_factory.mktemp("one_call"), vocab=48, layers=2, hidden=48, heads=2,
                            kv_heads=1, seed=3)


@pytest.fixture(scope="module")
def draft(path):
    m = load_model(path, field="draft").model
    assert m.one_call and why_not_one_call(m) is None and m.one_call_forward() is not None
    return m


IDS = [3, 17, 5, 9, 22, 1, 30, 8, 8, 14, 2, 39, 47, 0]


def run(m, ids, one_call=True, **kw):
    saved = m.one_call
    m.one_call = one_call
    try:
        return m(torch.tensor([ids]), m.new_cache(1, 64), **kw)[0]          # [T, V]
    finally:
        m.one_call = saved


def test_close_to_the_pytorch_forward(draft):
    a, b = run(draft, IDS), run(draft, IDS, one_call=False)
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    assert torch.equal(run(draft, IDS, last_only=True), a[-1:])


def test_a_tokens_logits_do_not_depend_on_its_block_or_batch(draft):
    block = run(draft, IDS)
    cache = draft.new_cache(1, 64)
    for t, tok in enumerate(IDS):                        # one token at a time
        assert torch.equal(draft(torch.tensor([[tok]]), cache)[0, 0], block[t])
        cache.advance(1)
    batch = draft.new_cache(2, 64)                       # beside another row of another length
    draft(torch.tensor([IDS[:5]]), batch.row_view(0))
    batch.lengths[:] = [5, 0]
    out = draft(torch.tensor([IDS[5:9], IDS[:4]]), batch)                      # [2, 4, V]
    assert torch.equal(out[0], block[5:9]) and torch.equal(out[1], block[:4])


def test_weights_bf16_holds_exactly_are_read_as_bf16_with_the_same_bits():
    w = torch.randn(24, 16)
    assert kept(w).dtype == torch.float32                                      # not exact: kept in fp32
    exact = w.to(torch.bfloat16).float()
    assert kept(exact).dtype == torch.bfloat16
    from leaplm.kernels.build import load

    ext = load()
    dec = {}
    for name, conv in (("fp32", lambda t: t), ("bf16", lambda t: t.to(torch.bfloat16))):
        g = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).float()     # noqa: E731
        d = ext.module.Decoder(2, 1, 8, 16, 24, 1e-5, ext.path)
        d.add_dense_layer(torch.ones(16), torch.ones(16), [conv(r(32, 16)), conv(r(16, 16)), conv(r(48, 16)),
                                                           conv(r(16, 24))], [torch.empty(0)] * 4)
        d.set_head(conv(r(10, 16)), torch.ones(16), conv(r(10, 16)))
        dec[name] = d
    cis = torch.view_as_real(torch.polar(torch.ones(64, 4), torch.rand(64, 4))).contiguous()
    outs = []
    for d in dec.values():
        k, v = [torch.zeros(1, 1, 64, 8)], [torch.zeros(1, 1, 64, 8)]
        e = torch.empty(0, dtype=torch.long)
        outs.append(d.logits(torch.tensor([1, 4, 2, 9]), 1, 4, k, v, [0], e, e, cis, 4, False))
    assert torch.equal(outs[0], outs[1])


def test_only_drafts_run_it(path, draft):
    target = load_model(path).model
    assert not target.one_call
    assert why_not_one_call(load_model(path, field="draft", quantization="int8").model) is not None


def test_greedy_speculation_through_it_is_token_identical_to_plain_decoding(path):
    from leaplm.config import SamplingParams
    from leaplm.engine.engine import Engine

    target = write_tiny_llama(path + "-target", vocab=48, layers=3, hidden=64, heads=4, kv_heads=2, seed=3)
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    prompt = "t3 t17 t5 t9 t22"
    plain = Engine(model=target, method="none").generate(prompt, params)
    spec = Engine(model=target, draft=path, method="draft", k=4, adaptive_k=False)
    assert spec.draft.model.one_call_forward() is not None
    out = spec.generate(prompt, params)
    assert out.token_ids == plain.token_ids and out.stats.draft_tokens > 0


def test_a_greedy_chain_in_one_call_drafts_and_caches_as_a_forward_per_token(draft):
    ids, k = IDS[:6], 5
    cache = draft.new_cache(1, 64)
    chain = draft.greedy_chain(ids, k, cache, real=40)             # argmax over the first 40 rows only
    ref, feed, rc = [], ids, draft.new_cache(1, 64)
    for _ in range(k):
        logits = draft(torch.tensor([feed]), rc, last_only=True)[0, -1]        # [V]
        rc.advance(len(feed))
        ref.append(int(logits[:40].argmax()))
        feed = [ref[-1]]
    assert chain == ref and cache.lengths == [0]                    # the length is the caller's to move
    n = len(ids) + k - 1                                            # ids and the first k - 1 drafts cached
    for layer in range(draft.num_layers):
        assert torch.equal(cache.k[layer][:, :, :n], rc.k[layer][:, :, :n])
    draft.one_call = False
    try:
        assert draft.greedy_chain(ids, k, draft.new_cache(1, 64), real=40) is None
    finally:
        draft.one_call = True

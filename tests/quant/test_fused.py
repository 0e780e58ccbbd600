"""The C++ layer loop (quant/fused.py) of a quantized model: close to the PyTorch layer loop over the same quantized
linears, and a token's logits bit-identical whatever the block it is computed in (T = 1 vs inside a block of
verification, a chain vs a tree, alone vs beside another batch row). Greedy identity of every method on a
quantized target runs through it too (test_quantized_model.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from leaplm.kernels.build import unavailable_reason
from leaplm.models import load_model
from leaplm.quant.fused import why_not_fused



def write_tiny_llama(*args, **kw):
    """tests/conftest.py's writer, by path (`from conftest import` finds whichever conftest pytest loaded first)."""
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


pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"C++ extension cannot be built here: {unavailable_reason()}")


@pytest.fixture(scope="module", params=["int8", "int4", "Q4_K_M"])
def model(request, tmp_path_factory):
    """A tiny model on the kernel: quantized at load (int8, int4) or a GGUF file's own Q4_K_M blocks (Q4_K, Q6_K,
    Q5_0 and Q8_0 matrices, the int4, int6 and int8 formats; tests/models/gguf_writer.py)."""
    if request.param == "Q4_K_M":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
        from gguf_writer import write_tiny_gguf

        path = write_tiny_gguf(tmp_path_factory.mktemp("fused_k"), "Q4_K_M", seed=5)[0]
        m = load_model(path, quantization="gguf").model
        assert {p.weight.fmt for lin in m.quantized.values() for p in lin.parts} == {"int8", "int4", "int6"}
        assert len(m.quantized["layers.0.self_attn.qkv.weight"].parts) == 2      # Q4_K q, k beside a Q6_K v
        assert why_not_fused(m) is None and m.fused_layers() is not None
        return m
    path = write_tiny_llama(tmp_path_factory.mktemp("fused"), vocab=40, layers=3, hidden=64, heads=4, kv_heads=2,
                            seed=5)
    m = load_model(path, quantization=request.param).model
    assert why_not_fused(m) is None and m.fused_layers() is not None
    return m


IDS = [3, 17, 5, 9, 22, 1, 30, 8, 8, 14, 2, 39]


def logits(m, ids, fused=True, **kw):
    m.layer_weights()
    saved = m._fused
    if not fused:
        m._fused = None
    try:
        cache = m.new_cache(1, 64)
        return m(torch.tensor([ids]), cache, **kw)[0]
    finally:
        m._fused = saved


def test_close_to_the_pytorch_layer_loop(model):
    a, b = logits(model, IDS), logits(model, IDS, fused=False)
    scale = b.abs().max().item()
    # the same quantized linears; norms, rope, attention and the activation rounded in another order: fp32 rounding
    # (~1e-7 of the logits' range), except where an activation's int8 rounding tips (a value within rounding error
    # of a half step goes the other way in one loop): one activation moves by one int8 step (1/127 of its block's
    # largest) and the positions after it move with it. The bound is one int8 step of the logits' range: a tip on
    # an AVX2 machine moved one position of qwen3_qknorm int4 by 0.0023 of it; the negative controls are 0.12-0.93
    assert torch.allclose(a, b, rtol=0, atol=scale / 127), ((a - b).abs().max() / scale).item()
    # negative control: a model with one layer fewer is far off
    c = logits(model, IDS, layers=list(range(model.num_layers - 1)))
    assert not torch.allclose(c, b, rtol=0, atol=scale / 127)


def test_a_token_is_bit_identical_in_any_block(model):
    full = logits(model, IDS)                                         # [12, V]: one block of 12
    cache = model.new_cache(1, 64)
    step = []
    for i, t in enumerate(IDS):                                       # one token at a time (plain decoding)
        step.append(model(torch.tensor([[t]]), cache)[0, 0])
        cache.advance(1)
    assert torch.equal(torch.stack(step), full)
    cache = model.new_cache(1, 64)                                    # prefix, then blocks of 5 and 4
    model(torch.tensor([IDS[:3]]), cache)
    cache.advance(3)
    assert torch.equal(model(torch.tensor([IDS[3:8]]), cache)[0], full[3:8])
    cache.advance(5)
    assert torch.equal(model(torch.tensor([IDS[8:]]), cache)[0], full[8:])


def test_every_block_size_up_to_32_gives_the_same_bits(model):
    """A block of T = 1..32 new tokens after a prefix: each token's logits equal the same token in one block of 40
    (which the linears take as 32 + 8 rows): the token tiles and the L1 chunks of the kernel never change a bit."""
    ids = [(7 * i + 3) % 40 for i in range(40)]
    full = logits(model, ids)                                         # [40, V]
    for T in range(1, 33):
        start = 40 - T
        cache = model.new_cache(1, 64)
        model(torch.tensor([ids[:start]]), cache)
        cache.advance(start)
        assert torch.equal(model(torch.tensor([ids[start:]]), cache)[0], full[start:]), T


def test_tree_node_equals_its_chain(model):
    """A flattened tree [a, b | a, c] (c a second child of a): each node equals the chain through it."""
    prefix, a, b, c = IDS[:6], 7, 11, 13
    cache = model.new_cache(1, 64)
    model(torch.tensor([prefix]), cache)
    cache.advance(len(prefix))
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = model(torch.tensor([[a, b, c]]), cache, tree_mask=mask, position_offsets=torch.tensor([0, 1, 1]))[0]
    assert torch.equal(tree[:2], logits(model, prefix + [a, b])[6:])
    assert torch.equal(tree[2], logits(model, prefix + [a, c])[7])


def test_batch_rows_are_independent(model):
    """Two rows of different lengths in one forward: each row's logits equal the row alone."""
    cache = model.new_cache(2, 64)
    rows = [IDS[:4], IDS[4:11]]
    for b, r in enumerate(rows):                                      # prefill each row on its own
        one = model.new_cache(1, 64)
        model(torch.tensor([r]), one)
        for i in range(model.num_layers):
            cache.k[i][b, :, :len(r)] = one.k[i][0, :, :len(r)]
            cache.v[i][b, :, :len(r)] = one.v[i][0, :, :len(r)]
        cache.lengths[b] = len(r)
    nxt = torch.tensor([[5, 6], [7, 8]])
    both = model(nxt, cache)
    for b, r in enumerate(rows):
        assert torch.equal(both[b], logits(model, r + nxt[b].tolist())[len(r):]), b


def test_reasons_it_does_not_apply(tmp_path):
    path = write_tiny_llama(tmp_path, vocab=16, layers=1, hidden=32, heads=2, kv_heads=1)
    assert why_not_fused(load_model(path).model) == "the linears are not quantized"
    m = load_model(path, quantization="int8").model
    m.args.hidden_act = "gelu"
    assert "SiLU" in why_not_fused(m)


def test_every_path_gives_the_same_bits(model):
    """The layer loop on the scalar path (baseline-built element-wise code, scalar kernel) equals the chosen path."""
    from leaplm.quant.fused import build_fused

    ext = next(iter(model.quantized.values())).parts[0].ext
    ids = IDS * 3                                                     # 36 tokens: linears of 32 and 4 rows
    fast = logits(model, ids)
    chosen = ext.path
    try:
        ext.path = 0
        model._fused = build_fused(model)
        slow = logits(model, ids)
    finally:
        ext.path = chosen
        model._fused = False
    assert torch.equal(slow, fast)


def test_the_thread_split_gives_the_same_bits(tmp_path):
    """The layer loop's regions (row groups of each linear, attention queries, SiLU rows) split across the kernel's
    threads: a block's logits are the same bits at 1, 2 and 3 threads. head_dim 64 and blocks of up to 32 tokens
    make the attention large enough to be split too."""
    path = write_tiny_llama(tmp_path, vocab=40, layers=2, hidden=256, heads=4, kv_heads=2, seed=7)
    m = load_model(path, quantization="int4").model
    assert m.fused_layers() is not None
    ids = [(5 * i + 1) % 40 for i in range(64)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [logits(m, ids[:T]) for T in (1, 9, 32, 64)]
        for n in (2, 3):
            torch.set_num_threads(n)
            assert all(torch.equal(logits(m, ids[:T]), y) for T, y in zip((1, 9, 32, 64), one)), n
    finally:
        torch.set_num_threads(before)


def test_region_timers_count_every_region_only_when_asked(tmp_path):
    """LEAPLM_KERNEL_PROFILE=1 (read when the library loads, so in a process of its own) sums each region of the
    layer loop; without it, profile() is empty."""
    import os
    import subprocess

    path = write_tiny_llama(tmp_path, vocab=40, layers=2, hidden=64, heads=2, kv_heads=1, seed=3)
    code = (f"import torch; from leaplm.models import load_model; from leaplm.kernels.build import load\n"
            f"m = load_model({str(path)!r}, quantization='int4').model\n"
            f"m(torch.tensor([[1, 2, 3, 4]]), m.new_cache(1, 16))\n"
            f"print(sorted((k, n) for k, (ms, n) in load().module.profile().items() if ms >= 0))")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}

    def regions(flag: str) -> list:
        out = subprocess.run([sys.executable, "-c", code], env={**env, "LEAPLM_KERNEL_PROFILE": flag},
                             capture_output=True, text=True, check=True).stdout
        return eval(out.strip().splitlines()[-1])

    on = dict(regions("1"))
    assert on["qkv"] == on["attention"] == on["o"] == on["gate_up"] == on["silu"] == on["down"] == 2   # per layer
    assert on["quantize"] >= 8 and on["qlinear"] == 1                                                 # + the head
    assert regions("0") == []

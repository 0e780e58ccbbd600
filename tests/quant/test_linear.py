"""The quantized linear: the C++ kernel's int8 arithmetic against slow readable references, its fixed reduction
order (a row's result is bit-identical alone or with 15 other rows, at any T, on every SIMD path), the path
chooser, and the pure-PyTorch fallback.

Tolerances. The kernel quantizes each token's activations per block of 32 to int8 (xq = qa * a, a = amax / 127,
so |x - xq| <= a / 2 per element), then sums exact integer block dot products P in fp32:
  vs the same arithmetic in float64 (`int8_reference`): only the fp32 roundings of 2 G + 1 operations differ,
      |y - ref| <= (2 G + 2) eps * sum_g (|s a P| + |m sa|);
  vs the dequantized weights times the fp32 activations: the activation rounding adds at most
      sum_g a_g / 2 * sum_{j in g} |w_j| per output (plus the summation-order term (2 K + 2) eps |x| @ |W|^T).
"""
from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from leaplm.kernels.build import PATHS, choose_path, load, probe_path, unavailable_reason
from leaplm.quant.formats import BLOCK, QuantizedWeight, dequantize, quantize
from leaplm.quant.linear import QuantizedLinear, pack, unpack

EPS = torch.finfo(torch.float32).eps
FORMATS = ["int8", "int4", "int6"]                # int6: GGUF Q6_K's form, a scale per 16 weights
needs_ext = pytest.mark.skipif(unavailable_reason() is not None,
                               reason=f"C++ extension cannot be built here: {unavailable_reason()}")


def case(fmt, T, N=40, K=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    return quantize(w, fmt), torch.randn(T, K, generator=g), torch.randn(N, generator=g)


def quantize_activations_ref(x):
    """x [T, K] fp32 -> (qa [T, K] int8, a [T, K / 32] fp32): per block of 32, a = amax / 127, qa = round half to
    even of x * (1 / a), clamped to +-127; the same fp32 operations as the kernel, so the result is exact."""
    T, K = x.shape
    b = x.reshape(T, K // BLOCK, BLOCK)
    a = b.abs().amax(-1) / 127                                                  # [T, G]
    inv = torch.where(a > 0, 1 / a, torch.zeros_like(a))
    qa = torch.round(b * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return qa.reshape(T, K), a


def int8_reference(qw, x):
    """The kernel's arithmetic in float64: (y [T, N], magnitude [T, N] = sum_g |s a P| + |m sa|). int6: P and s
    per half block of 16 (G counts halves)."""
    qa, a = quantize_activations_ref(x)
    T, K = x.shape
    N, G = qw.scale.shape
    if qw.fmt == "int6":
        a = a.repeat_interleave(2, 1)                                           # [T, G]: a block's a per half
    if qw.fmt in ("int8", "int6"):
        q = qw.q.reshape(N, G, -1).long()
    else:
        p = qw.q.reshape(N, G, BLOCK // 2).long()
        q = torch.cat([p & 0x0F, p >> 4], -1)                                   # [N, G, 32]
    P = torch.einsum("ngj,tgj->tng", q, qa.reshape(T, G, -1).long()).double()   # exact block dots [T, N, G]
    d = (qw.scale.unsqueeze(0) * a.unsqueeze(1)).double()                       # fp32 product, as the kernel
    terms = P * d
    mag = terms.abs()
    if qw.minv is not None:
        sa = (a * qa.reshape(T, G, BLOCK).sum(-1).float()).double()             # [T, G]
        mt = qw.minv.double().unsqueeze(0) * sa.unsqueeze(1)
        terms, mag = terms + mt, mag + mt.abs()
    return terms.sum(-1), mag.sum(-1)


def run_path(ext, qw, x, path, bias=None):
    p = pack(qw)
    return ext.module.qlinear(x, p.q, p.scale, p.minv, bias, p.rows, path)


def usable_paths():
    ext = load()
    return [p for p in PATHS if p <= ext.path]


@needs_ext
def test_activation_quantization_matches_its_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 128, generator=g) * torch.tensor([1e-3, 1, 30, 1e4]).repeat_interleave(32)
    x[2, 32:64] = 0                                                             # an all-zero block: a = 0, qa = 0
    x[3, :32] = torch.arange(32) / 31 * 127 * 0.5                               # exact halves: round to even
    rqa, ra = quantize_activations_ref(x)
    for path in usable_paths():                                                 # scalar C++ and the SIMD form
        qa, a = load().module.quantize_activations(x, path)
        assert torch.equal(qa, rqa) and torch.equal(a, ra), path


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 3, 8, 16])
def test_every_path_matches_the_float64_reference_of_its_arithmetic(fmt, T):
    qw, x, _ = case(fmt, T, N=37, K=160, seed=T)
    ref, mag = int8_reference(qw, x)
    G = qw.scale.shape[1]
    for path in usable_paths():
        y = run_path(load(), qw, x, path)
        assert y.shape == (T, 37)
        assert ((y.double() - ref).abs() <= (2 * G + 2) * EPS * mag).all(), PATHS[path]
    # negative control: one weight integer off by one is far outside the bound
    bad = QuantizedWeight(qw.fmt, qw.q.clone(), qw.scale, qw.minv)
    bad.q[4, 9] += 1
    assert not ((run_path(load(), bad, x, 0).double() - ref).abs() <= (2 * G + 2) * EPS * mag).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("extension", marks=needs_ext)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 3, 8, 16, 37])
def test_matches_dequantized_reference(backend, fmt, T):
    qw, x, bias = case(fmt, T)
    lin = QuantizedLinear(qw, backend)
    assert lin.backend == backend
    w = dequantize(qw)
    ref = F.linear(x.double(), w.double(), bias.double())
    y = lin(x, bias)
    assert y.shape == (T, qw.out_features) and y.dtype == torch.float32
    K = w.shape[1]
    bound = (2 * K + 2) * EPS * (x.abs() @ w.abs().T) + EPS * bias.abs()
    if backend == "extension":                     # + the activation rounding: half a step per element
        a = x.reshape(T, -1, BLOCK).abs().amax(-1) / 127                        # [T, G]
        wsum = w.abs().reshape(w.shape[0], -1, BLOCK).sum(-1)                   # [N, G]
        bound = bound + (a / 2) @ wsum.T * (1 + 4 * EPS)
    assert ((y - ref).abs() <= bound).all()
    # negative control: one row's weights scaled by 1.5 (a wrong block scale) are outside the bound
    w_bad = w.clone()
    w_bad[5] *= 1.5
    assert not ((F.linear(x, w_bad, bias) - ref).abs() <= bound).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("extension", marks=needs_ext)])
def test_shapes_and_bf16_activations(backend):
    qw, x, _ = case("int4", 6)
    lin = QuantizedLinear(qw, backend)
    y = lin(x.view(2, 3, -1).bfloat16())
    assert y.shape == (2, 3, qw.out_features) and y.dtype == torch.bfloat16
    ref = F.linear(x.bfloat16().float(), dequantize(qw)).view(2, 3, -1)
    assert torch.allclose(y.float(), ref, rtol=2 ** -5, atol=2 ** -5 * ref.abs().max().item())


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
def test_row_is_bit_identical_alone_or_with_15_others(fmt):
    qw, x, bias = case(fmt, 16, N=72, K=160, seed=3)
    lin = QuantizedLinear(qw, "extension")
    together = lin(x, bias)                                            # [16, N]
    for t in range(16):
        assert torch.equal(lin(x[t:t + 1], bias), together[t:t + 1]), t
    for T in range(2, 16):                                             # every token-tile width, at an offset
        off = 16 - T if T > 8 else 3
        assert torch.equal(lin(x[off:off + T], bias), together[off:off + T]), T
    # more than 32 rows go through the kernel 32 at a time: still row-independent
    big = torch.cat([x, x.flip(0), x, x[:7]])
    assert torch.equal(lin(big, bias)[:16], together)
    # an output row alone (its weight row packed on its own) is the same bits as inside the matrix
    for n in (0, 13, 71):
        alone = QuantizedLinear(qw.rows(torch.tensor([n])), "extension")(x, bias[n:n + 1])   # [16, 1]
        assert torch.equal(alone[:, 0], together[:, n]), n


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
def test_long_rows_in_blocks_of_1_to_32_give_the_same_bits_on_every_path(fmt):
    """K = 1280 (40 blocks of 32): blocks of many tokens walk the blocks in chunks that keep their activations in
    L1 (16 blocks a pass at T = 32); a token's result is still the same bits alone, at any T up to 32, at any
    offset, and on every path."""
    qw, x, bias = case(fmt, 32, N=21, K=1280, seed=6)
    lin = QuantizedLinear(qw, "extension")
    together = lin(x, bias)                                            # [32, N]: one kernel call
    for T in range(1, 33):
        off = (5 * T) % (33 - T)
        assert torch.equal(lin(x[off:off + T], bias), together[off:off + T]), T
    ext = load()
    for p in usable_paths():
        for T in (1, 7, 17, 32):
            assert torch.equal(run_path(ext, qw, x[:T].contiguous(), p, bias), together[:T]), (p, T)


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
def test_simd_and_scalar_paths_agree_bit_for_bit(fmt):
    ext = load()
    paths = usable_paths()
    if len(paths) == 1:
        pytest.skip(f"no SIMD path is usable on this machine ({ext.why})")
    qw, x, _ = case(fmt, 16, N=45, K=224, seed=4)
    x[1] *= 1e-20                                                      # tiny and huge activations in one call
    x[2] *= 1e20
    for T in (1, 2, 5, 9, 16):
        ys = [run_path(ext, qw, x[:T].contiguous(), p) for p in paths]
        assert all(torch.equal(ys[0], y) for y in ys[1:]), T


def tiles_at_every_block_size(ext):
    """Where ext runs the AMX path: its tile products at every block size and format until the generator is
    closed, then the tuned sizes again."""
    on = ext is not None and ext.path == 3
    before = {int4: ext.module.amx_tokens(int4) for int4 in (False, True)} if on else {}
    for int4 in before:
        ext.module.set_amx_tokens(int4, list(range(1, 33)))
    yield ext
    for int4, tokens in before.items():
        ext.module.set_amx_tokens(int4, tokens)


@pytest.fixture
def every_block_on_tiles():
    """The AMX path's tile products for every block size and format (skipped where the AMX path does not run)."""
    ext = load()
    if ext is None or ext.path != 3:
        pytest.skip(f"the AMX path does not run on this machine ({ext.why if ext else 'no extension'})")
    yield from tiles_at_every_block_size(ext)


@pytest.fixture
def every_block_on_tiles_if_amx():
    """every_block_on_tiles where the AMX path runs, else the machine's own paths as they are."""
    yield from tiles_at_every_block_size(load())


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
def test_tile_products_give_the_scalar_paths_bits_at_every_block_size(fmt, every_block_on_tiles):
    """Every tile width (1..16 tokens, and 17..32 as two tiles), an odd number of row groups (the last one on
    the AVX-512 instructions) and an odd number of blocks (the pipeline's last stage half full): the same bits as
    the scalar path and as the AVX-512 VNNI path."""
    ext = every_block_on_tiles
    qw, x, _ = case(fmt, 32, N=45, K=224, seed=5)
    x[3] *= 1e-20
    x[4] *= 1e20
    for T in range(1, 33):
        xt = x[:T].contiguous()
        tiles = run_path(ext, qw, xt, 3)
        assert torch.equal(tiles, run_path(ext, qw, xt, 0)), T
        assert torch.equal(tiles, run_path(ext, qw, xt, 2)), T


def test_amx_tuning_keeps_the_block_sizes_the_tiles_run_faster():
    """tune_amx times both forms at every size and keeps those where the tiles' median is lower (an injected
    clock: tiles faster from 12 tokens for int8, from 20 for int4)."""
    from leaplm.kernels.build import AMX_TOKENS, tune_amx

    class Module:
        def __init__(self):
            self.tokens = {False: [], True: []}
            self.calls = []

        def set_amx_tokens(self, int4, tokens):
            self.tokens[int4] = list(tokens)

        def qlinear(self, x, qp, sp, mp, bias, n, path):
            self.calls.append((mp is not None, x.shape[0], bool(self.tokens[mp is not None])))

    module = Module()
    faster_from = {False: 12, True: 20}

    def timer(fn):
        before = len(module.calls)
        fn()
        int4, T, tiles = module.calls[before]
        return 1.0 if tiles and T >= faster_from[int4] else 1.1 if tiles else 1.05

    got = tune_amx(module, reps=3, timer=timer)
    assert got == {"int8": [T for T in AMX_TOKENS if T >= 12], "int4": [T for T in AMX_TOKENS if T >= 20]}
    assert module.tokens == {False: got["int8"], True: got["int4"]}          # left set to the answer


@pytest.fixture
def threads():
    """Sets torch's thread count for one test (the suite runs at 1) and restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_thread_split_gives_the_same_bits(fmt, threads):
    """The row groups of a call are split across the kernel's threads in chunks claimed in any order: each row's
    result is the same bits at 1, 2 and 3 threads (N = 400: 50 row groups, several chunks per thread)."""
    qw, x, bias = case(fmt, 32, N=400, K=320, seed=8)
    lin = QuantizedLinear(qw, "extension")
    threads(1)
    one = {T: lin(x[:T], bias) for T in (1, 5, 16, 32)}
    for n in (2, 3):
        threads(n)
        for T, y in one.items():
            assert torch.equal(lin(x[:T], bias), y), (n, T)


@needs_ext
def test_the_pool_runs_every_item_once_on_every_thread(threads):
    """The kernel's thread pool: every item runs exactly once; with 2 threads and items long enough (2 ms each)
    the worker runs some of them beside the caller; at 1 thread the caller runs them all."""
    ext = load()
    threads(2)
    who, runs = ext.module.pool_probe(16, 1, 2000)
    assert runs.tolist() == [1] * 16
    assert (who == 0).any() and (who > 0).any(), who.tolist()         # the caller and a worker
    who, runs = ext.module.pool_probe(100, 7, 0)                       # a ragged last chunk
    assert runs.tolist() == [1] * 100 and (who >= 0).all()
    threads(1)
    who, runs = ext.module.pool_probe(16, 1, 0)
    assert runs.tolist() == [1] * 16 and who.tolist() == [0] * 16


@needs_ext
def test_an_error_inside_the_pool_reaches_the_caller_and_the_pool_still_works(threads):
    ext = load()
    threads(2)
    for throw_at in (0, 9):                                            # the caller's first chunk, a later one
        with pytest.raises(RuntimeError, match=f"item {throw_at} throws"):
            ext.module.pool_probe(12, 1, 500, throw_at)
    who, runs = ext.module.pool_probe(12, 1, 500)
    assert runs.tolist() == [1] * 12


@needs_ext
def test_q4_0_and_q4_1_blocks_as_stored():
    """Q4_0 runs as int4 with min = -8 * scale: same result as the signed weights (q - 8) * scale."""
    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 256, (24, 64), dtype=torch.uint8, generator=g)
    d = torch.rand(24, 4, generator=g)
    q40 = QuantizedWeight("int4", q, d, -8 * d)
    nib = torch.cat([(q & 15).reshape(24, 4, 16), (q >> 4).reshape(24, 4, 16)], -1).reshape(24, 128)
    q8 = QuantizedWeight("int8", (nib.to(torch.int16) - 8).to(torch.int8), d, None)
    x = torch.randn(5, 128, generator=g)
    a, b = QuantizedLinear(q40, "extension")(x), QuantizedLinear(q8, "extension")(x)
    ref, mag = int8_reference(q8, x)
    assert ((a.double() - ref).abs() <= 12 * EPS * mag).all() and ((b.double() - ref).abs() <= 12 * EPS * mag).all()


@needs_ext
@pytest.mark.parametrize("fmt", FORMATS)
def test_extension_and_fallback_agree(fmt):
    qw, x, bias = case(fmt, 9, seed=5)
    a, b = QuantizedLinear(qw, "extension")(x, bias), QuantizedLinear(qw, "torch")(x, bias)
    w = dequantize(qw)
    act = (x.reshape(9, -1, BLOCK).abs().amax(-1) / 254) @ w.abs().reshape(w.shape[0], -1, BLOCK).sum(-1).T
    assert ((a - b).abs() <= 2 * (2 * 96 + 2) * EPS * (x.abs() @ w.abs().T) + act * 1.01 + 2 * EPS * bias.abs()).all()


class FakeModule:
    """Stands in for the compiled module in the path chooser: paths 3 (AMX) and 2 die with SIGILL (or path 3
    alone is refused, as where the operating system withholds the tile registers), path 1 returns `wrong` results
    when asked to, the scalar path the reference."""

    def __init__(self, path1_wrong=False, path1_dies=False, amx_refused=False):
        self.path1_wrong, self.path1_dies, self.amx_refused = path1_wrong, path1_dies, amx_refused

    def set_amx_tokens(self, int4, tokens):
        pass

    def qlinear(self, x, qp, sp, mp, bias, n, path):
        import os

        if path == 3 and self.amx_refused:
            raise RuntimeError("path 3 (AMX): the operating system does not grant the tile registers")
        if path >= 2 and not self.amx_refused or (path == 1 and self.path1_dies):
            os.kill(os.getpid(), signal.SIGILL)
        y = torch.zeros(x.shape[0], n)
        return y + 1 if (path == 1 and self.path1_wrong) else y


def test_path_chooser_survives_a_faulting_path():
    assert probe_path(FakeModule(), 3) == "died with SIGILL"
    assert probe_path(FakeModule(), 2) == "died with SIGILL"
    path, why = choose_path(FakeModule())
    assert path == 1 and "AVX2" in why


def test_path_chooser_passes_over_amx_where_the_tiles_are_refused():
    assert probe_path(FakeModule(amx_refused=True), 3) == "failed"
    path, why = choose_path(FakeModule(amx_refused=True))
    assert path == 2 and "AVX-512 VNNI" in why


def test_path_chooser_falls_back_to_scalar_and_says_why():
    path, why = choose_path(FakeModule(path1_wrong=True))
    assert path == 0 and "scalar" in why and "SIGILL" in why and "disagreed" in why
    path, why = choose_path(FakeModule(path1_dies=True))
    assert path == 0 and why.count("SIGILL") == 3


def test_unknown_backend_is_refused():
    qw, _, _ = case("int8", 1)
    with pytest.raises(ValueError, match="backend"):
        QuantizedLinear(qw, "amx")


def test_pack_keeps_every_integer_and_scale():
    """The row-group layout is a permutation: unpacking it gives back the weight's numbers."""
    for fmt, width, scales in (("int8", 256, 1), ("int4", 128, 1)):
        qw, _, _ = case(fmt, 1, N=19, K=64)
        p = pack(qw)
        assert p.q.shape == (3, 2, width) and p.scale.shape == (3, 2 * scales, 8) and p.rows == 19
        chunks = width // 32
        q = p.q.reshape(3, 2, chunks, 8, 4).permute(0, 3, 1, 2, 4).reshape(24, -1)[:19]
        assert torch.equal(q, qw.q.view(torch.uint8))
        assert torch.equal(p.scale.transpose(1, 2).reshape(24, 2 * scales)[:19], qw.scale)
        assert (p.q.reshape(3, 2, chunks, 8, 4)[2, :, :, 3:] == 0).all()      # padding rows are zero


def test_int6_packs_into_six_bits_a_weight_as_the_kernel_reads_them():
    """Q6_K's integers in 24 bytes a row and block (the file's size): each weight read back element by element
    from the documented bit positions (kernels/common.h) equals the integer it packed; padding rows read 0."""
    qw, _, _ = case("int6", 1, N=19, K=64)
    p = pack(qw)
    assert p.q.shape == (3, 2, 192) and p.scale.shape == (3, 4, 8) and p.rows == 19
    b = p.q.reshape(3, 2, 192)
    for n in range(24):
        grp, r = divmod(n, 8)
        for g in range(2):
            for j in range(32):
                e, c = j % 16, j // 4
                nib = int(b[grp, g, ((e // 4) * 8 + r) * 4 + e % 4])
                low = nib & 15 if j < 16 else nib >> 4
                top = (int(b[grp, g, 128 + ((c // 4) * 8 + r) * 4 + j % 4]) >> (2 * (c % 4))) & 3
                want = int(qw.q[n, 32 * g + j]) if n < 19 else 0
                assert (low | top << 4) - 32 == want, (n, g, j)
    assert torch.equal(p.scale.transpose(1, 2).reshape(24, 4)[:19], qw.scale)


# ---- the kernel's layout straight from a GGUF file's blocks ---------------------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "int4", "int6"])
def test_unpack_inverts_pack(fmt):
    from leaplm.quant.linear import unpack

    w = quantize(torch.randn(21, 96, generator=torch.Generator().manual_seed(3)), fmt)   # 21: a partial group
    back = unpack(pack(w))
    assert back.fmt == w.fmt and torch.equal(back.q, w.q) and torch.equal(back.scale, w.scale)
    assert (back.minv is None) == (w.minv is None) and (w.minv is None or torch.equal(back.minv, w.minv))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_pack_gguf_equals_packing_the_blocks_read_as_weights(qtype):
    """Fused tensors (16 + 8 + 24 rows), one of them reordered: the same integers as from_gguf_blocks, cat_rows and
    pack, and the same scales and minimums kept in fp16 as the file holds them (equal once widened, so the
    kernel's products are the same); rows that do not split into groups of 8 are left to that path (None)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from leaplm.quant.formats import cat_rows, from_gguf_blocks
    from leaplm.quant.linear import pack_gguf

    rng = np.random.default_rng(0)
    K = 96
    raws = [gguf_quantize(rng.standard_normal((n, K)).astype(np.float32), GGMLQuantizationType[qtype])
            for n in (16, 8, 24)]
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    have = pack_gguf(raws, qtype, [perm, None, None])
    parts = [from_gguf_blocks(r, qtype, (r.shape[0], K)) for r in raws]
    want = pack(cat_rows([parts[0].rows(perm)] + parts[1:]))
    assert have.rows == want.rows == 48
    assert have.q.dtype == want.q.dtype and torch.equal(have.q, want.q)
    assert have.scale.dtype == torch.float16 and torch.equal(have.scale.float(), want.scale)
    assert (have.minv is None) == (want.minv is None) == (qtype == "Q8_0")
    if qtype == "Q4_0":                       # no minimum stored: each is -8 times its scale
        assert have.minv.tolist() == [-8.0]
    elif have.minv is not None:
        assert have.minv.dtype == torch.float16 and torch.equal(have.minv.float(), want.minv)
    assert torch.equal(unpack(have).scale, unpack(want).scale)
    assert (want.minv is None) or torch.equal(unpack(have).minv, unpack(want).minv)
    assert pack_gguf([raws[0][:12], raws[1]], qtype) is None


@needs_ext
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_fp16_scales_give_the_fp32_scales_bits_on_every_path(qtype, every_block_on_tiles_if_amx):
    """A GGUF tensor packed with its fp16 scales and the same packed with them widened to fp32 (and Q4_0's
    minimums, taken as -8 times the scales, stored one by one): the same bits on every path and block size (the
    kernel widens them exactly before any product)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    from leaplm.quant.linear import PackedWeight, pack_gguf

    rng = np.random.default_rng(2)
    K = 160
    p16 = pack_gguf([gguf_quantize(rng.standard_normal((40, K)).astype(np.float32), GGMLQuantizationType[qtype])],
                    qtype)
    minv32 = None if p16.minv is None else p16.minv.float()
    if qtype == "Q4_0":
        assert p16.minv.numel() == 1
        minv32 = -8 * p16.scale.float()                                  # [N/8, G, 8]: each stored
    p32 = PackedWeight(p16.q, p16.scale.float(), minv32, p16.rows)
    ext = load()
    x = torch.randn(32, K, generator=torch.Generator().manual_seed(3))
    run = lambda p, xt, path: ext.module.qlinear(xt, p.q, p.scale, p.minv, None, p.rows, path)   # noqa: E731
    for T in range(1, 33):
        xt = x[:T].contiguous()
        ref = run(p32, xt, 0)
        for path in usable_paths():
            assert torch.equal(run(p16, xt, path), ref), (T, path)
            assert torch.equal(run(p32, xt, path), ref), (T, path)


@needs_ext
def test_a_linear_from_packed_weights_computes_as_one_from_the_weight():
    from leaplm.quant.linear import unpack

    w = quantize(torch.randn(40, 96, generator=torch.Generator().manual_seed(4)), "int4")
    a, b = QuantizedLinear(w, "extension"), QuantizedLinear.from_packed(pack(w))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a(x), b(x))
    assert b.nbytes == w.nbytes and torch.equal(b.weight.q, unpack(pack(w)).q)


def test_the_build_directory_is_torch_s(monkeypatch):
    """built_library() finds the directory torch.utils.cpp_extension builds in without importing it, so a built
    library is reused by name (with and without TORCH_EXTENSIONS_DIR)."""
    from torch.utils.cpp_extension import _get_build_directory

    from leaplm.kernels.build import built_library

    for env in (None, "/tmp/leaplm-ext-dir"):
        if env is None:
            monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCH_EXTENSIONS_DIR", env)
        b = built_library()
        assert str(b.build_dir) == _get_build_directory(b.name, verbose=False)


@needs_ext
def test_a_split_linear_is_its_row_blocks_side_by_side():
    """q/k/v held as int4 (Q4_K q, k) and int6 (a Q6_K v): one linear of two row blocks, each row the same bits as
    its block alone; blocks of one format stay one matrix."""
    from leaplm.quant.linear import SplitLinear, fused_linear

    a, x, bias = case("int4", 7, N=20, K=256, seed=8)
    b, _, _ = case("int6", 7, N=13, K=256, seed=9)
    lin = fused_linear([a, b], "extension")
    assert isinstance(lin, SplitLinear) and lin.formats == "int4/int6" and lin.out_features == 33
    assert lin.nbytes == a.nbytes + 13 * (256 * 6 // 8 + 16 * 4)     # the int6 block in 6 bits a weight, fp32 scales
    y = lin(x, torch.cat([bias[:20], bias[:13]]))
    want = torch.cat([QuantizedLinear(a, "extension")(x, bias[:20]), QuantizedLinear(b, "extension")(x, bias[:13])], -1)
    assert torch.equal(y, want)
    assert isinstance(fused_linear([a, a], "extension"), QuantizedLinear)

"""The C++ layer loop's options (kernels/decoder.h LayerOptions, Decoder's act) against a small readable reference:
GELU-tanh, per-head q/k norms, post-attention and post-MLP norms, a rope table and an attention scale per layer,
over a prefix written to the cache and a block after it. The layers are dense fp32 (add_dense_layer): the weights
are exact, so the loop differs from the reference only by fp32 rounding; the options run the same code for
quantized layers (quant/fused.py's tests check those against the PyTorch layer loop)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from leaplm.kernels.build import load, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"C++ extension cannot be built here: {unavailable_reason()}")

H, HKV, D, HID, INTER, EPS, P = 4, 2, 16, 64, 96, 1e-6, 32
BASES = (10_000.0, 1_000_000.0)                   # two rope tables: a local and a global base, as Gemma 3 has


@dataclass
class RefLayer:
    """One layer's weights and options, in the reference's terms (every tensor fp32)."""
    ln1: torch.Tensor            # [hid] the norm before attention
    ln2: torch.Tensor            # [hid] the norm before the MLP
    qkv: torch.Tensor            # [(H + 2 Hkv) D, hid]
    o: torch.Tensor              # [hid, H D]
    gate_up: torch.Tensor        # [2 inter, hid]
    down: torch.Tensor           # [hid, inter]
    q_norm: torch.Tensor | None  # [D]
    k_norm: torch.Tensor | None  # [D]
    post_attn: torch.Tensor | None   # [hid]
    post_mlp: torch.Tensor | None    # [hid]
    rope: int
    scale: float | None


def rope_tables() -> torch.Tensor:
    """[R, P, D / 2, 2] (cos, sin) for each base, pairs (2i, 2i + 1) rotated by position * base^(-2i / D)."""
    inv = torch.stack([1.0 / (b ** (torch.arange(0, D, 2, dtype=torch.float64) / D)) for b in BASES])   # [R, D/2]
    ang = torch.arange(P, dtype=torch.float64).view(1, P, 1) * inv.view(len(BASES), 1, D // 2)           # [R, P, D/2]
    return torch.stack([ang.cos(), ang.sin()], -1).float().contiguous()


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rotate(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cs [T, D / 2, 2]: each pair (a, b) -> (a cos - b sin, a sin + b cos)."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cs[:, None, :, 0], cs[:, None, :, 1]
    return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)


def gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))


def reference(x: torch.Tensor, layers: list[RefLayer], cis: torch.Tensor, act: str, linear=None) -> torch.Tensor:
    """x [T, hid] (tokens at positions 0 .. T - 1, causal) -> [T, hid] after the layers, in float64. linear(i, name,
    h) stands in for h @ w.T with layer i's weight `name` (a quantized weight's own kernel)."""
    x, cis = x.double(), cis.double()
    T = x.shape[0]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i, L in enumerate(layers):
        w = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in vars(L).items()}
        mm = (lambda name, h: h @ w[name].T) if linear is None else (lambda name, h: linear(i, name, h))   # noqa: E731
        qkv = mm("qkv", rms(x, w["ln1"]))
        q = qkv[:, :H * D].view(T, H, D)
        k = qkv[:, H * D:(H + HKV) * D].view(T, HKV, D)
        v = qkv[:, (H + HKV) * D:].view(T, HKV, D)
        if L.q_norm is not None:
            q, k = rms(q, w["q_norm"]), rms(k, w["k_norm"])
        q, k = rotate(q, cis[L.rope, :T]), rotate(k, cis[L.rope, :T])
        scale = L.scale if L.scale is not None else 1 / math.sqrt(D)
        heads = []
        for h in range(H):
            g = h // (H // HKV)
            s = (q[:, h] @ k[:, g].T * scale).masked_fill(~causal, float("-inf"))    # [T, T]
            heads.append(s.softmax(-1) @ v[:, g])
        o = mm("o", torch.cat(heads, -1))
        x = x + (rms(o, w["post_attn"]) if L.post_attn is not None else o)
        gu = mm("gate_up", rms(x, w["ln2"]))
        g, u = gu[:, :INTER], gu[:, INTER:]
        m = mm("down", (gelu_tanh(g) if act == "gelu_tanh" else g * torch.sigmoid(g)) * u)
        x = x + (rms(m, w["post_mlp"]) if L.post_mlp is not None else m)
    return x


def make_layers(seed: int, **over) -> list[RefLayer]:
    """Two layers with every option set (norm weights 1 + noise, so a norm dropped or swapped shows); `over`
    replaces options in both."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / math.sqrt(s[-1])        # noqa: E731
    n = lambda k: 1 + 0.3 * torch.randn(k, generator=g)                    # noqa: E731
    out = []
    for i in range(2):
        opts = dict(q_norm=n(D), k_norm=n(D), post_attn=n(HID), post_mlp=n(HID), rope=i % 2, scale=0.3 + 0.2 * i)
        opts.update(over)
        out.append(RefLayer(n(HID), n(HID), r((H + 2 * HKV) * D, HID), r(HID, H * D), r(2 * INTER, HID),
                            r(HID, INTER), **opts))
    return out


def decoder(layers: list[RefLayer], act: str, path: int | None = None):
    ext = load()
    d = ext.module.Decoder(H, HKV, D, HID, INTER, EPS, ext.path if path is None else path, act=act)
    for L in layers:
        d.add_dense_layer(L.ln1, L.ln2, [L.qkv, L.o, L.gate_up, L.down], [torch.empty(0)] * 4, q_norm=L.q_norm,
                          k_norm=L.k_norm, post_attn_norm=L.post_attn, post_mlp_norm=L.post_mlp, rope=L.rope,
                          attn_scale=L.scale)
    return d


def run(d, x: torch.Tensor, cis: torch.Tensor, split: int) -> torch.Tensor:
    """x [T, hid] through the loop as a prefix of `split` tokens, then the rest as one block after the cache."""
    T = x.shape[0]
    ks = [torch.zeros(1, HKV, P, D) for _ in range(2)]
    vs = [torch.zeros(1, HKV, P, D) for _ in range(2)]
    none, nomask = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool)
    a = d.forward(x[:split].contiguous(), 1, split, ks, vs, [0], none, nomask, cis, [0, 1], split)
    b = d.forward(x[split:].contiguous(), 1, T - split, ks, vs, [split], none, nomask, cis, [0, 1], T)
    return torch.cat([a, b])


def tolerance(y: torch.Tensor) -> float:
    """The worst-case rounding of an fp32 sum over the longest reduction (n eps for n terms: the down projection's
    `inter`; attention's and the norms' sums are shorter), relative to the largest output."""
    return torch.finfo(torch.float32).eps * INTER * y.abs().max().item()


X = torch.randn(11, HID, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_every_option_matches_the_reference(act):
    layers, cis = make_layers(1), rope_tables()
    want = reference(X, layers, cis, act).float()
    got = run(decoder(layers, act), X, cis, split=7)
    assert (got - want).abs().max().item() <= tolerance(want), (got - want).abs().max().item()


@pytest.mark.parametrize("change", ["no post norms", "rope tables swapped", "default scale", "no q/k norms",
                                    "other activation"])
def test_negative_control_each_option_changes_the_result(change):
    """The reference with one option changed is far from the loop with it: each option is really applied (and the
    tolerance is tight enough to see it)."""
    layers, cis = make_layers(1), rope_tables()
    got = run(decoder(layers, "gelu_tanh"), X, cis, split=7)
    act = "gelu_tanh"
    if change == "other activation":
        act = "silu"
    else:
        over = {"no post norms": dict(post_attn=None, post_mlp=None), "default scale": dict(scale=None),
                "no q/k norms": dict(q_norm=None, k_norm=None)}.get(change, {})
        for L in layers:
            for k, v in over.items():
                setattr(L, k, v)
            if change == "rope tables swapped":
                L.rope = 1 - L.rope
    want = reference(X, layers, cis, act).float()
    assert (got - want).abs().max().item() > 10 * tolerance(want)


def test_the_scalar_path_gives_the_same_bits():
    """The options' arithmetic (norms per head, GELU-tanh's exp) is built for the baseline and for AVX2 alike."""
    layers, cis = make_layers(2), rope_tables()
    assert torch.equal(run(decoder(layers, "gelu_tanh", path=0), X, cis, 7), run(decoder(layers, "gelu_tanh"), X, cis, 7))


def test_a_token_is_bit_identical_in_any_block():
    layers, cis = make_layers(4), rope_tables()
    d = decoder(layers, "gelu_tanh")
    whole = run(d, X, cis, split=1)
    for split in (3, 6, 10):
        assert torch.equal(run(d, X, cis, split), whole), split


def test_one_table_is_every_layers():
    """cis [P, D / 2, 2] (one table) is table 0 of a stack: layers that all read table 0 give the same bits."""
    layers, cis = make_layers(5, rope=0), rope_tables()
    d = decoder(layers, "silu")
    assert torch.equal(run(d, X, cis[0].contiguous(), 4), run(d, X, cis, 4))


def test_bad_options_are_refused_by_name():
    ext = load()
    with pytest.raises(RuntimeError, match="act"):
        ext.module.Decoder(H, HKV, D, HID, INTER, EPS, ext.path, act="relu")
    d = ext.module.Decoder(H, HKV, D, HID, INTER, EPS, ext.path)
    L = make_layers(6)[0]
    w, b = [L.qkv, L.o, L.gate_up, L.down], [torch.empty(0)] * 4
    with pytest.raises(RuntimeError, match="q_norm and k_norm"):
        d.add_dense_layer(L.ln1, L.ln2, w, b, q_norm=L.q_norm)
    with pytest.raises(RuntimeError, match="post_mlp_norm"):
        d.add_dense_layer(L.ln1, L.ln2, w, b, post_mlp_norm=torch.ones(HID + 1))
    with pytest.raises(RuntimeError, match="attn_scale"):
        d.add_dense_layer(L.ln1, L.ln2, w, b, attn_scale=0.0)
    d.add_dense_layer(L.ln1, L.ln2, w, b, rope=2)                    # table 2 of the two given: refused at forward
    with pytest.raises(RuntimeError, match="rope table 2 of 2"):
        d.forward(X[:2].contiguous(), 1, 2, [torch.zeros(1, HKV, P, D)], [torch.zeros(1, HKV, P, D)], [0],
                  torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool), rope_tables(), [0], 2)


def quantized_decoder(layers: list[RefLayer], act: str, fmt: str):
    """The layers' weights quantized to `fmt` and packed, in a Decoder (add_layer, the path quant/fused.py builds),
    and linear(i, name, h) running layer i's packed weight `name` alone through the kernel's qlinear (the same
    activation quantization), for the reference."""
    from leaplm.quant.formats import quantize
    from leaplm.quant.linear import pack

    ext = load()
    d = ext.module.Decoder(H, HKV, D, HID, INTER, EPS, ext.path, act=act)
    empty, packed = torch.empty(0), []
    for L in layers:
        ps = [pack(quantize(w, fmt)) for w in (L.qkv, L.o, L.gate_up, L.down)]
        packed.append(dict(zip(("qkv", "o", "gate_up", "down"), ps)))
        d.add_layer(L.ln1, L.ln2, [[p.q] for p in ps], [[p.scale] for p in ps],
                    [[empty if p.minv is None else p.minv] for p in ps], [empty] * 4, [[p.rows] for p in ps],
                    q_norm=L.q_norm, k_norm=L.k_norm, post_attn_norm=L.post_attn, post_mlp_norm=L.post_mlp,
                    rope=L.rope, attn_scale=L.scale)

    def linear(i: int, name: str, h: torch.Tensor) -> torch.Tensor:
        p = packed[i][name]
        return ext.module.qlinear(h.float().contiguous(), p.q, p.scale, p.minv, None, p.rows, ext.path).double()

    return d, linear


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_layers_take_the_same_options(fmt):
    """add_layer's options over packed weights: close to the reference whose linears are the same packed weights
    through qlinear, within test_fused.py's bound (the other operations rounded in another order, and the
    activations' int8 roundings that this can tip: 1/127 of a block's largest, an eighth of that on the largest
    output); the rope tables swapped is far off (negative control)."""
    layers, cis = make_layers(7), rope_tables()
    d, linear = quantized_decoder(layers, "gelu_tanh", fmt)
    got = run(d, X, cis, split=7)
    want = reference(X, layers, cis, "gelu_tanh", linear).float()
    bound = want.abs().max().item() / 127 / 8
    assert (got - want).abs().max().item() <= bound, (got - want).abs().max().item()
    for L in layers:
        L.rope = 1 - L.rope
    assert (got - reference(X, layers, cis, "gelu_tanh", linear).float()).abs().max().item() > 10 * bound

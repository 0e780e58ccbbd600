"""`leaplm bench --roofline`: how far decoding is from the memory-bandwidth floor.

A decoder must read every weight once per forward, so a forward cannot take less than
bytes read / streaming bandwidth. The bandwidth is measured as /work/shared/tools/machine_limits.py does: one
token through F.linear over an fp32 matrix far larger than any cache. The report gives, for the model at hand:
bytes per forward (linear weights in their stored format, norms, one embedding row), the floor in ms, the
measured forward time for T = 1..16 tokens (what verifying K + 1 tokens costs), and for each method the decode
time per token split into propose / score (target forwards) / rest (verify, commit, host work), against the
floor. Speculative methods can go below the floor per token: that is the mean accepted length at work.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class ForwardCost:
    tokens: int                 # T new tokens per forward
    ms: float                   # median ms per forward
    vs_one: float               # ms / ms of T = 1


@dataclass
class MethodCost:
    config: str
    ms_per_token: float         # median decode ms per generated token
    propose_ms: float           # per generated token
    score_ms: float
    verify_ms: float
    commit_ms: float
    rest_ms: float              # host work between the stages (K choice, block building, stats)
    mean_accepted_length: float
    vs_floor: float             # ms_per_token / floor_ms


@dataclass
class Roofline:
    model: str
    quantization: str | None
    kernel: str                 # how the linears run
    weight_bytes: int           # bytes read per forward
    bandwidth_GBps: float
    floor_ms: float
    threads: int
    forwards: list[ForwardCost] = field(default_factory=list)
    methods: list[MethodCost] = field(default_factory=list)


def bytes_per_forward(model) -> int:
    """Bytes one forward of one token reads: every linear weight as stored (quantized or not), the norms and one
    embedding row. The KV cache is left out (small at the contexts measured here)."""
    total = 0
    q = getattr(model, "quantized", {})
    for name, p in model.named_parameters(remove_duplicate=False):   # a tied head is listed under both names
        if name in q:
            total += q[name].weight.nbytes
        elif name == "embed_tokens.weight":
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def stream_bandwidth(hidden: int = 4096, reps: int = 7) -> float:
    """GB/s of one token through F.linear over an fp32 [hidden, 4 hidden] matrix (machine_limits' method)."""
    w = torch.randn(hidden, 4 * hidden)
    x = torch.randn(1, 4 * hidden)
    return w.numel() * w.element_size() / _median(lambda: F.linear(x, w), reps) / 1e9


def forward_costs(model, tokens=(1, 2, 4, 8, 12, 16), ctx: int = 64, reps: int = 15) -> list[ForwardCost]:
    """Median ms of a forward over T new tokens after `ctx` cached ones, the T values interleaved per repeat."""
    cache = model.new_cache(1, ctx + max(tokens) + 1)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.randint(0, model.vocab_size, (1, ctx), generator=g), cache)
        cache.advance(ctx)
        blocks = {T: torch.randint(0, model.vocab_size, (1, T), generator=g) for T in tokens}
        times: dict[int, list[float]] = {T: [] for T in tokens}
        for T in tokens:                                     # warm-up
            model(blocks[T], cache)
        for _ in range(reps):
            for T in tokens:
                t = time.perf_counter()
                model(blocks[T], cache)
                times[T].append(time.perf_counter() - t)
    med = {T: statistics.median(v) * 1e3 for T, v in times.items()}
    return [ForwardCost(T, round(med[T], 3), round(med[T] / med[tokens[0]], 3)) for T in tokens]


def method_costs(engines: dict, prompts: list[str], max_new_tokens: int, rounds: int, floor_ms: float,
                 params_cls) -> list[MethodCost]:
    """Each engine generates every prompt each round (order rotated); medians of per-request figures."""
    per: dict[str, list] = {name: [] for name in engines}
    names = list(engines)
    params = params_cls(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    for name in names:                                       # warm-up
        engines[name].generate(prompts[0], params_cls(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    for r in range(rounds):
        for pi, prompt in enumerate(prompts):
            shift = (r + pi) % len(names)
            for name in names[shift:] + names[:shift]:
                per[name].append(engines[name].generate(prompt, params).stats)
    out = []
    for name, stats in per.items():
        tok = lambda f: statistics.median(f(s) / max(1, s.new_tokens) * 1e3 for s in stats)
        ms = tok(lambda s: s.decode_s)
        prop, score = tok(lambda s: s.propose_s), tok(lambda s: s.score_s)
        ver, com = tok(lambda s: s.verify_s), tok(lambda s: s.commit_s)
        tau = sum(s.new_tokens for s in stats) / max(1, sum(s.target_forwards for s in stats))
        out.append(MethodCost(name, round(ms, 3), round(prop, 3), round(score, 3), round(ver, 3), round(com, 3),
                              round(max(0.0, ms - prop - score - ver - com), 3), round(tau, 3),
                              round(ms / floor_ms, 3)))
    return out


def _median(fn, reps: int) -> float:
    fn()
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)

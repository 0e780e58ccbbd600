"""`leaplm bench --roofline`: how far decoding is from the memory-bandwidth floor.

A decoder must read every weight once per forward, so a forward cannot take less than
bytes read / streaming bandwidth. The bandwidth is measured as /work/shared/tools/machine_limits.py does: one
token through F.linear over an fp32 matrix far larger than any cache. The report gives, for the model at hand:
bytes per forward (linear weights in their stored format, norms, one embedding row), the floor in ms, the
measured forward time for T = 1..16 tokens (what verifying K + 1 tokens costs; the whole-forward curve runs to 32), and for each method the decode
time per token split into propose / score (target forwards) / rest (verify, commit, host work), against the
floor. Speculative methods can go below the floor per token: that is the mean accepted length at work.

Block-cost curves: per GGUF weight type (Q4_0, Q4_1, Q8_0), what the model's linear layers cost over T = 1..16
tokens in leaplm's int8 kernel (weights of the model's shapes in that type, the T values interleaved per repeat),
beside two floors: the bandwidth floor (the weights' bytes / the streaming bandwidth: T = 1 cannot go below it)
and the int8 compute floor (multiply-adds * T / the machine's int8 rate, measured with the kernel's own
dot-product instruction on all threads). A flat curve makes verifying K + 1 tokens cost about what one costs.
Other kernels (llama.cpp's) add their curves to `Roofline.curves` under their own name.
"""
from __future__ import annotations

import random
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
    k: int = 0                  # the most draft tokens a step of this configuration verifies (0: plain decoding)
    adaptive_k: bool = False    # whether the K policy chose K per step (then fewer than k were often verified)
    drafting: float = 0.0       # share of target forwards that verified a draft (the rest scored one token)
    block: float = 1.0          # mean tokens in a forward that verified a draft: 1 + drafted tokens per such step
    blocks: dict[str, int] = field(default_factory=dict)   # drafting steps by their block T ("5": 1 + 4 drafts),
                                                           # so a projection can price each block size on the curve
    totals: dict[str, float] = field(default_factory=dict)  # ms_per_token, propose_ms, score_ms over the run's
                                                            # tokens (sums, not medians): the footing of its tau


@dataclass
class BlockCurve:
    """One kernel's cost of a forward's linear layers over T tokens, for one weight type."""
    kernel: str                     # "leaplm int8 (AVX-512 VNNI)", "llama.cpp", ...
    weight_type: str                # "Q4_0" | "Q4_1" | "Q8_0"
    tokens: list[int]               # T values measured
    ms: list[float]                 # median ms per T
    vs_one: list[float]             # ms / ms at the first T
    weight_bytes: int               # bytes of the linear weights as this kernel stores them
    bandwidth_floor_ms: float       # weight_bytes / streaming bandwidth
    compute_floor_ms: list[float]   # multiply-adds * T / int8 rate, per T


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
    int8_GMACs: float = 0.0         # int8 multiply-adds per second (all threads), 0 when not measured
    curves: list[BlockCurve] = field(default_factory=list)
    curves_note: str = ""           # why a curve is missing, if one is
    weight_type: str = ""           # the file's own main weight type (GGUF), "" otherwise
    break_even: list["BreakEven"] = field(default_factory=list)
    one_token_vs_llamacpp: "OneTokenPairing | None" = None    # --baselines llamacpp


@dataclass
class OneTokenPairing:
    """leaplm's one-token forward against llama-bench's pp1 on the same file and threads, in alternating rounds
    (leaplm's forwards, then one llama-bench process, ...) so both see the same machine."""
    command: str                          # the llama-bench command of every round
    rounds: list[tuple[float, float]]     # (leaplm ms, llama-bench pp1 ms) per round
    leaplm_ms: float                      # medians over the rounds
    llama_ms: float
    ratio: float                          # median of the rounds' leaplm / llama-bench (below 1: leaplm faster)


def bytes_per_forward(model) -> int:
    """Bytes one forward of one token reads: every linear weight as stored (quantized or not), the norms and one
    embedding row. The KV cache is left out (small at the contexts measured here)."""
    total = 0
    q = getattr(model, "quantized", {})
    for name, p in model.named_parameters(remove_duplicate=False):   # a tied head is listed under both names
        if name in q:
            total += q[name].nbytes
        elif name == "embed_tokens.weight":
            eq = getattr(model, "embed_quantized", None)   # a GGUF embedding looked up row by row from its blocks
            total += eq.nbytes // eq.out_features if eq is not None else p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def stream_bandwidth(hidden: int = 4096, reps: int = 7) -> float:
    """GB/s of one token through F.linear over an fp32 [hidden, 4 hidden] matrix (machine_limits' method)."""
    w = torch.randn(hidden, 4 * hidden)
    x = torch.randn(1, 4 * hidden)
    return w.numel() * w.element_size() / _median(lambda: F.linear(x, w), reps) / 1e9


def forward_costs(model, tokens=(1, 2, 4, 8, 12, 16), ctx: int = 64, reps: int = 15,
                  argmax: bool = False) -> list[ForwardCost]:
    """Median ms of a forward over T new tokens after `ctx` cached ones, the T values interleaved per repeat in an
    order shuffled each repeat (seeded), so that no T always follows the same one. A forward among larger ones
    runs slower than the same forward repeated (SmolLM2 Q4_1 on a Xeon: one token 5.8-6.1 ms within a sweep of
    1..32 tokens, 4.8 ms repeated alone), so ratios compare within one call, not across calls. argmax: the
    forward a greedy verify runs (forward_argmax: each position's argmax, no logits written)."""
    run = model.forward_argmax if argmax else model
    cache = model.new_cache(1, ctx + max(tokens) + 1)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        model(torch.randint(0, model.vocab_size, (1, ctx), generator=g), cache)
        cache.advance(ctx)
        blocks = {T: torch.randint(0, model.vocab_size, (1, T), generator=g) for T in tokens}
        times: dict[int, list[float]] = {T: [] for T in tokens}
        for T in tokens:                                     # warm-up
            run(blocks[T], cache)
        order, shuffle = list(tokens), random.Random(0).shuffle
        for _ in range(reps):
            shuffle(order)
            for T in order:
                t = time.perf_counter()
                run(blocks[T], cache)
                times[T].append(time.perf_counter() - t)
    med = {T: statistics.median(v) * 1e3 for T, v in times.items()}
    return [ForwardCost(T, round(med[T], 3), round(med[T] / med[tokens[0]], 3)) for T in tokens]


def pair_one_token(model, llama_pp1_ms, rounds: int = 7, forwards: int = 40, ctx: int = 64,
                   command: str = "") -> OneTokenPairing:
    """OneTokenPairing over `rounds`: each round times `forwards` one-token forwards of `model` after `ctx` cached
    tokens (median), then calls llama_pp1_ms() (a llama-bench run; its ms per token)."""
    cache = model.new_cache(1, ctx + 2)
    g = torch.Generator().manual_seed(0)
    out = []
    with torch.inference_mode():
        model(torch.randint(0, model.vocab_size, (1, ctx), generator=g), cache)
        cache.advance(ctx)
        one = torch.randint(0, model.vocab_size, (1, 1), generator=g)
        for _ in range(5):                                   # warm-up
            model(one, cache)
        for _ in range(rounds):
            ts = []
            for _ in range(forwards):
                t = time.perf_counter()
                model(one, cache)
                ts.append(time.perf_counter() - t)
            out.append((round(statistics.median(ts) * 1e3, 3), round(llama_pp1_ms(), 3)))
    return OneTokenPairing(command, out, round(statistics.median(a for a, _ in out), 3),
                           round(statistics.median(b for _, b in out), 3),
                           round(statistics.median(a / b for a, b in out), 3))


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
        spec = engines[name].spec
        k = 0 if spec.method == "none" else spec.k
        fwd = max(1, sum(s.target_forwards for s in stats))
        steps = sum(s.steps_with_draft for s in stats)
        drafted = sum(s.draft_tokens for s in stats)
        out.append(MethodCost(name, round(ms, 3), round(prop, 3), round(score, 3), round(ver, 3), round(com, 3),
                              round(max(0.0, ms - prop - score - ver - com), 3), round(tau, 3),
                              round(ms / floor_ms, 3), k, bool(k and spec.adaptive_k), round(steps / fwd, 4),
                              round(1 + drafted / steps, 3) if steps else 1.0, block_counts(stats),
                              run_totals(stats)))
    return out


def run_totals(stats) -> dict[str, float]:
    """Decode, propose and score ms per generated token over all of a configuration's requests (their sums): what
    the mean accepted length (also a ratio of sums) goes with. The medians of per-request figures beside it mix two
    averages, which disagree for a method whose acceptance varies by request (suffix on copied text and on code)."""
    new = max(1, sum(s.new_tokens for s in stats))
    per = lambda f: round(sum(f(s) for s in stats) / new * 1e3, 4)     # noqa: E731
    return {"ms_per_token": per(lambda s: s.decode_s), "propose_ms": per(lambda s: s.propose_s),
            "score_ms": per(lambda s: s.score_s)}


def block_counts(stats) -> dict[str, int]:
    """Drafting steps by block size T = 1 + drafted tokens, from the requests' drafted_by_position (position i was
    proposed by every step that drafted more than i tokens, so the steps that drafted exactly d are
    count[d - 1] - count[d])."""
    n = max((len(s.drafted_by_position) for s in stats), default=0)
    by = [sum(s.drafted_by_position[i] for s in stats if i < len(s.drafted_by_position)) for i in range(n)] + [0]
    return {str(d + 1): by[d - 1] - by[d] for d in range(1, n + 1) if by[d - 1] - by[d]}


@dataclass
class BreakEven:
    """Where speculation can pay on one kernel: a step verifying K drafts scores a block of K + 1 tokens, which
    costs block_cost forwards of one token; the method pays for its score stage only where its mean accepted length
    (tokens per target forward) exceeds that."""
    config: str
    kernel: str
    weight_type: str
    block_tokens: int           # K + 1
    block_cost: float           # ms of a forward over K + 1 tokens / ms of one
    mean_accepted_length: float
    pays: bool                  # mean_accepted_length > block_cost


def single_row_forward(kernel: str) -> bool:
    """A whole forward of one row ('... forward', not '... forward, 4 rows' nor the linears alone)."""
    return "forward" in kernel and "rows" not in kernel


def break_even(methods: list[MethodCost], curves: list[BlockCurve], weight_type: str) -> list[BreakEven]:
    """Each speculating method against each whole-forward curve of `weight_type` (the file's own)."""
    out = []
    for m in methods:
        for c in curves:
            if (m.k < 1 or c.weight_type != weight_type or not single_row_forward(c.kernel)
                    or m.k + 1 not in c.tokens):
                continue
            cost = c.vs_one[c.tokens.index(m.k + 1)]
            out.append(BreakEven(m.config, c.kernel, weight_type, m.k + 1, cost, m.mean_accepted_length,
                                 m.mean_accepted_length > cost))
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


# bytes per 32 weights in the int8 kernel's storage (fp32 scale, + fp32 min for Q4) and in a GGUF file (fp16)
KERNEL_BLOCK_BYTES = {"Q4_0": 16 + 8, "Q4_1": 16 + 8, "Q8_0": 32 + 4}
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
WEIGHT_TYPES = tuple(KERNEL_BLOCK_BYTES)


def linear_shapes(args) -> list[tuple[int, int]]:
    """(out, in) of every linear weight one forward reads, fused as the native model holds them, lm_head last."""
    H, Hkv, D, hid, inter = (args.num_attention_heads, args.num_key_value_heads, args.head_dim, args.hidden_size,
                             args.intermediate_size)
    per_layer = [((H + 2 * Hkv) * D, hid), (hid, H * D), (2 * inter, hid), (hid, inter)]
    return per_layer * args.num_hidden_layers + [(args.vocab_size, hid)]


def random_weight(shape: tuple[int, int], weight_type: str, g: torch.Generator):
    """A QuantizedWeight of `shape` with random integers and scales in `weight_type`'s form (speed does not depend
    on the values)."""
    from ..quant.formats import BLOCK, QuantizedWeight

    N, K = shape
    s = torch.rand(N, K // BLOCK, generator=g) * 0.01
    if weight_type == "Q8_0":
        return QuantizedWeight("int8", torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g), s, None)
    q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    m = -8 * s if weight_type == "Q4_0" else torch.randn(N, K // BLOCK, generator=g) * 0.01
    return QuantizedWeight("int4", q, s, m)


def int8_rate(ext, reps: int = 3) -> float:
    """Multiply-adds per second of the extension's dot-product instruction on all threads (median of reps)."""
    iters = 4_000_000                                                  # ~20 ms a thread: waking threads is noise
    ext.module.int8_peak(ext.path, iters // 10)                        # warm-up (clocks, thread pool)
    return statistics.median(ext.module.int8_peak(ext.path, iters) for _ in range(reps))


def kernel_block_costs(shapes: list[tuple[int, int]], weight_type: str, bandwidth_GBps: float, macs_per_s: float,
                       tokens=tuple(range(1, 17)), reps: int = 5, seed: int = 0) -> BlockCurve:
    """Median ms of the int8 kernel over all `shapes` for each T, the T values interleaved per repeat."""
    from ..kernels.build import load
    from ..quant.linear import QuantizedLinear

    ext = load()
    g = torch.Generator().manual_seed(seed)
    lins = [QuantizedLinear(random_weight(s, weight_type, g), "extension") for s in shapes]
    for lin in lins:                                 # keep only what the kernel reads
        lin.weight = None
    ins = {K: {T: torch.randn(T, K, generator=g) for T in tokens} for K in {k for _, k in shapes}}

    def forward(T: int) -> None:
        for lin, (_, K) in zip(lins, shapes):
            lin(ins[K][T])

    times: dict[int, list[float]] = {T: [] for T in tokens}
    for T in tokens:                                 # warm-up
        forward(T)
    for _ in range(reps):
        for T in tokens:
            t = time.perf_counter()
            forward(T)
            times[T].append(time.perf_counter() - t)
    med = [statistics.median(times[T]) * 1e3 for T in tokens]
    nbytes = sum(n * k for n, k in shapes) * KERNEL_BLOCK_BYTES[weight_type] // 32
    macs = sum(n * k for n, k in shapes)
    from ..kernels.build import PATHS

    return BlockCurve(f"leaplm int8 ({PATHS[ext.path]})", weight_type, list(tokens), [round(m, 3) for m in med],
                      [round(m / med[0], 3) for m in med], nbytes, round(nbytes / (bandwidth_GBps * 1e9) * 1e3, 3),
                      [round(macs * T / macs_per_s * 1e3, 3) for T in tokens])


def forward_curve(model, weight_type: str, bandwidth_GBps: float, tokens=tuple(range(1, 33)),
                  macs_per_s: float = 0.0, argmax: bool = False) -> BlockCurve:
    """leaplm's whole forward (every layer, attention, the output projection) over T tokens, as a BlockCurve
    labelled with the weight type its linears hold: comparable with llama.cpp's whole-forward curves. With the
    machine's int8 rate (macs_per_s > 0), the arithmetic floor per T: the linears' multiply-adds x T / the rate.
    argmax: the greedy verify's forward (the output layer's argmax alone), labelled "leaplm forward, argmax head"."""
    fc = forward_costs(model, tokens=tokens, reps=7, argmax=argmax)
    nbytes = bytes_per_forward(model)
    macs = sum(n * k for n, k in linear_shapes(model.args))
    floor = [round(macs * T / macs_per_s * 1e3, 3) for T in tokens] if macs_per_s > 0 else []
    name = "leaplm forward, argmax head" if argmax else "leaplm forward"
    return BlockCurve(name, weight_type, list(tokens), [f.ms for f in fc], [f.vs_one for f in fc], nbytes,
                      round(nbytes / (bandwidth_GBps * 1e9) * 1e3, 3), floor)

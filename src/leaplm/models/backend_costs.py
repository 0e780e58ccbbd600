"""`--backend auto` by measurement: a GGUF file the int8 kernel takes is timed on both engines at start-up.

Which engine runs a file faster depends on the file (weight types, sizes) and the machine: on SmolLM2 Q4_1 the
kernel scores one token and a block of 8 faster than libllama, on other exports libllama's one-token kernel wins.
So both are loaded once, a forward of one token and one of a block (BLOCK tokens, what a verify step scores) is
timed on each after a short context, interleaved, medians kept; the result is stored in the start-up cache
(startup_cache.py, kind "backend-costs": per file, machine, thread count and version), so later starts read it.

The choice (choose_by_costs) is a pure function of the measurement: plain decoding takes the engine with the
faster one-token forward, a speculating method the faster block, except that a speculating method stays on the
kernel where libllama is not batch-invariant for the file (there only the kernel keeps greedy output identical).
"""
from __future__ import annotations

import gc
import logging
import statistics
import time
from dataclasses import asdict, dataclass

import torch

log = logging.getLogger(__name__)

BLOCK = 8                 # tokens of the timed block (a verify step of K = 7)
CTX = 32                  # cached tokens before the timed forwards
REPEATS = 5               # timed forwards per engine and T (interleaved; medians)


@dataclass(frozen=True)
class BackendCosts:
    """Median ms of one forward on each engine after CTX cached tokens (start-up measurement)."""
    kernel_one_ms: float          # leaplm's int8 kernel, 1 token
    kernel_block_ms: float        # leaplm's int8 kernel, BLOCK tokens
    llamacpp_one_ms: float        # libllama, 1 token
    llamacpp_block_ms: float      # libllama, BLOCK tokens
    llamacpp_invariant: bool      # libllama's block and one-token kernels give the same bits for this file
    threads: int


@dataclass(frozen=True)
class CostChoice:
    backend: str                  # 'torch' (the kernel, quantization 'gguf') | 'llamacpp'
    reason: str


def choose_by_costs(method: str, c: BackendCosts) -> CostChoice:
    """The engine for `method` ('none': plain decoding) given the measured costs (see the module docstring)."""
    one = (f"one token {c.kernel_one_ms:.2f} ms on leaplm's int8 kernel, {c.llamacpp_one_ms:.2f} ms on libllama")
    block = (f"a block of {BLOCK} {c.kernel_block_ms:.2f} ms on the kernel, {c.llamacpp_block_ms:.2f} ms on "
             f"libllama")
    measured = f"measured at start-up, {c.threads} threads"
    if method == "none":
        kernel = c.kernel_one_ms <= c.llamacpp_one_ms
        return CostChoice("torch" if kernel else "llamacpp", f"plain decoding: {one} ({measured})")
    if not c.llamacpp_invariant:
        return CostChoice("torch", f"method {method} verifies blocks: libllama is not batch-invariant for this "
                                   f"file, the kernel is; {block} ({measured})")
    kernel = c.kernel_block_ms <= c.llamacpp_block_ms
    return CostChoice("torch" if kernel else "llamacpp", f"method {method} verifies blocks: {block} ({measured})")


def forward_ms(model, tokens=(1, BLOCK), ctx: int = CTX, repeats: int = REPEATS, rows: int = 1) -> dict[int, float]:
    """Median ms of one forward over `rows` rows of T tokens each after `ctx` cached tokens per row, for each T;
    the T values interleaved per repeat (order reversed every other one), rolled back after each forward."""
    cache = model.new_cache(rows, ctx + max(tokens) + 1)
    g = torch.Generator().manual_seed(0)
    model(torch.randint(0, model.vocab_size, (rows, ctx), generator=g), cache, last_only=True)
    for b in range(rows):
        cache.advance(ctx, b)
    blocks = {T: torch.randint(0, model.vocab_size, (rows, T), generator=g) for T in tokens}
    for T in tokens:                                             # warm-up
        model(blocks[T], cache)
    times: dict[int, list[float]] = {T: [] for T in tokens}
    for r in range(repeats):
        for T in (tokens if r % 2 == 0 else tokens[::-1]):
            t = time.perf_counter()
            model(blocks[T], cache)
            times[T].append(time.perf_counter() - t)
    return {T: statistics.median(v) * 1e3 for T, v in times.items()}


def measure(path: str, load_kernel) -> BackendCosts:
    """Load the file on each engine in turn and time it (about a second on a small model). load_kernel(path): the
    file's model on the int8 kernel (loading.py passes its loader)."""
    from .llamacpp.model import LlamaCppLM

    kernel = load_kernel(path)
    k = forward_ms(kernel)
    del kernel
    gc.collect()
    lm = LlamaCppLM(path)
    invariant = lm.batch_invariant
    ll = forward_ms(lm)
    del lm
    gc.collect()
    return BackendCosts(k[1], k[BLOCK], ll[1], ll[BLOCK], invariant, torch.get_num_threads())


def cached_costs(path: str, load_kernel) -> BackendCosts:
    """measure(path, load_kernel), or its result from the start-up cache (--recalibrate measures again)."""
    from .. import startup_cache

    key = startup_cache.key("backend-costs", startup_cache.file_identity(path), torch.get_num_threads(), BLOCK, CTX)
    hit = startup_cache.read_json("backend-costs", key)
    if hit is not None:
        try:
            return BackendCosts(**hit)
        except TypeError:
            pass
    costs = measure(path, load_kernel)
    startup_cache.write_json("backend-costs", key, asdict(costs))
    log.info("backend costs of %s: %s", path, costs)
    return costs

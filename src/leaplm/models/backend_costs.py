"""`--backend auto` by measurement: a GGUF file the int8 kernel takes is timed on both engines at start-up.

Which engine runs a file faster depends on the file (weight types, sizes) and the machine: on SmolLM2 Q4_1 the
kernel scores one token and a block of 8 faster than libllama, on other exports libllama's one-token kernel wins.
So both are loaded once, a forward of one token and one of a block (BLOCK tokens, what a verify step scores) is
timed on each after a short context, interleaved, medians kept; the result is stored in the start-up cache
(startup_cache.py, kind "backend-costs": per file, machine, thread count and version), so later starts read it.
libllama's batch-invariance check (LlamaCppLM.batch_variance: about a second per attention kind tried) matters only
to a speculating method, so a start for plain decoding leaves it out and the first speculating start adds it to
the entry (its own cache entry, kind "batch-variance", answers it when libllama has run the file before).

A file of more than TIMED_BYTES and TIMED_LAYERS decoder layers is timed on TIMED_LAYERS of them spread over its depth
and on every other one of those (each forward with the embedding, the final norm and the output projection), and
each engine's whole forward is estimated from the two: the fixed part (the head, the forward's own costs) plus the
per-layer slope times the file's layers. The kernel runs the subsets by the forward's `layers` argument on the file
it loads anyway (the engine's own load reads its packed weights back: models/packed_cache.py), libllama on copies
of the file cut to those layers (models/gguf_truncate.py), so a first start costs a few layers' forwards however
large the model. Why two subsets: in a few layers the output projection weighs as much as the layers (an 8B
file's head streams as many bytes as four of its layers), and the engines' heads and layers differ in speed, so a
subset's forward alone misjudges the model (the 8B shape, timed on 4 layers and the head alone, goes to libllama,
which decodes it no faster). Why spread: a _M mix gives some layers more bits (llama.cpp's use_more_bits: the first
eighth among them), so the first layers are not the file's average. A smaller file is timed whole.

The choice (choose_by_costs) is a pure function of the measurement: plain decoding takes the engine with the
faster one-token forward, a speculating method the faster block, except that a speculating method stays on the
kernel where libllama is not batch-invariant for the file (there only the kernel keeps greedy output identical).
"""
from __future__ import annotations

import gc
import logging
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

log = logging.getLogger(__name__)

BLOCK = 8                 # tokens of the timed block (a verify step of K = 7)
CTX = 32                  # cached tokens before the timed forwards
REPEATS = 5               # timed forwards per engine and T (interleaved; medians)
TIMED_LAYERS = 4          # a file with more decoder layers is timed on this many of them and half of those (docstring)
TIMED_BYTES = 1 << 30     # ... when it is larger than this (a smaller file's whole forwards take well under a second)


@dataclass(frozen=True)
class BackendCosts:
    """Median ms of one forward on each engine after CTX cached tokens (start-up measurement)."""
    kernel_one_ms: float          # leaplm's int8 kernel, 1 token
    kernel_block_ms: float        # leaplm's int8 kernel, BLOCK tokens
    llamacpp_one_ms: float        # libllama, 1 token
    llamacpp_block_ms: float      # libllama, BLOCK tokens
    llamacpp_invariant: bool | None   # libllama's block and one-token kernels give the same bits for this file;
                                      # None: not checked (plain decoding does not ask)
    threads: int
    layers_timed: int = 0             # the costs are estimated from forwards over layers_timed layers and half of
                                      # them (and the head), for all layers_total; 0: timed whole
    layers_total: int = 0


@dataclass(frozen=True)
class CostChoice:
    backend: str                  # 'torch' (the kernel, quantization 'gguf') | 'llamacpp'
    reason: str


def choose_by_costs(method: str, c: BackendCosts) -> CostChoice:
    """The engine for `method` ('none': plain decoding) given the measured costs (see the module docstring)."""
    one = (f"one token {c.kernel_one_ms:.2f} ms on leaplm's int8 kernel, {c.llamacpp_one_ms:.2f} ms on libllama")
    block = (f"a block of {BLOCK} {c.kernel_block_ms:.2f} ms on the kernel, {c.llamacpp_block_ms:.2f} ms on "
             f"libllama")
    measured = f"measured at start-up, {c.threads} threads" + (
        f", estimated for {c.layers_total} layers from {c.layers_timed // 2} and {c.layers_timed} of them and the "
        f"head" if c.layers_timed else "")
    if method == "none":
        kernel = c.kernel_one_ms <= c.llamacpp_one_ms
        return CostChoice("torch" if kernel else "llamacpp", f"plain decoding: {one} ({measured})")
    if c.llamacpp_invariant is None:
        raise ValueError("choose_by_costs: a speculating method needs libllama's batch-invariance check")
    if not c.llamacpp_invariant:
        return CostChoice("torch", f"method {method} verifies blocks: libllama is not batch-invariant for this "
                                   f"file, the kernel is; {block} ({measured})")
    kernel = c.kernel_block_ms <= c.llamacpp_block_ms
    return CostChoice("torch" if kernel else "llamacpp", f"method {method} verifies blocks: {block} ({measured})")


def forward_ms(model, tokens=(1, BLOCK), ctx: int = CTX, repeats: int = REPEATS, rows: int = 1,
               new_cache=None, layers: int | list[int] | None = None) -> dict[int, float]:
    """Median ms of one forward over `rows` rows of T tokens each after `ctx` cached tokens per row, for each T;
    the T values interleaved per repeat (order reversed every other one), rolled back after each forward.
    new_cache(rows, max_len): the cache to time in (default model.new_cache); layers: run only the first this
    many decoder layers, or those listed (a native model's forward takes the subset)."""
    cache = (new_cache or model.new_cache)(rows, ctx + max(tokens) + 1)
    g = torch.Generator().manual_seed(0)
    sub = {} if layers is None else {"layers": range(layers) if isinstance(layers, int) else list(layers)}
    model(torch.randint(0, model.vocab_size, (rows, ctx), generator=g), cache, last_only=True, **sub)
    for b in range(rows):
        cache.advance(ctx, b)
    blocks = {T: torch.randint(0, model.vocab_size, (rows, T), generator=g) for T in tokens}
    for T in tokens:                                             # warm-up
        model(blocks[T], cache, **sub)
    times: dict[int, list[float]] = {T: [] for T in tokens}
    for r in range(repeats):
        for T in (tokens if r % 2 == 0 else tokens[::-1]):
            t = time.perf_counter()
            model(blocks[T], cache, **sub)
            times[T].append(time.perf_counter() - t)
    return {T: statistics.median(v) * 1e3 for T, v in times.items()}


def measure(path: str, load_kernel, check_invariance: bool = True) -> BackendCosts:
    """Load the file on each engine in turn and time it (about a second on a small model). load_kernel(path): the
    file's model on the int8 kernel (loading.py passes its loader). libllama is timed in a context of its own
    default attention (flash attention) before any check; check_invariance: run its batch-invariance check too."""
    import tempfile

    from .gguf import parse_gguf
    from .gguf_truncate import cut_bytes, scratch_dir, truncate_gguf
    from .llamacpp.caches import LlamaCppCache
    from .llamacpp.model import LlamaCppLM

    kernel = load_kernel(path)
    n = kernel.num_layers
    cut = n > TIMED_LAYERS and Path(path).stat().st_size > TIMED_BYTES
    subsets = timed_subsets(n) if cut else [None]
    if cut:     # the first forwards after a load run slower (pages of the weights first touched): not timed
        forward_ms(kernel, layers=subsets[-1], repeats=1)
    k = [forward_ms(kernel, layers=s) for s in subsets]
    del kernel
    gc.collect()
    ll, invariant = [], None
    for s in subsets:
        scratch = scratch_dir(cut_bytes(path, s)) if s is not None else None
        with tempfile.TemporaryDirectory(prefix="leaplm-cut-", dir=scratch) as tmp:
            ll_path = path if s is None else str(truncate_gguf(path, s, Path(tmp) / "cut.gguf"))
            lm = LlamaCppLM(ll_path)
            ll.append(forward_ms(lm, new_cache=lambda rows, m: LlamaCppCache(lm, rows, m)))
            # a cut file's matrices have the whole file's shapes and types: the same kernels, the same answer
            if check_invariance and s is subsets[-1]:
                invariant = lm.batch_invariant
            del lm
            gc.collect()
    if cut:
        parse_gguf(path)                     # the mapping of the whole file again, not the deleted cuts'
    one = [whole_ms([t[1] for t in k], subsets, n), whole_ms([t[1] for t in ll], subsets, n)]
    block = [whole_ms([t[BLOCK] for t in k], subsets, n), whole_ms([t[BLOCK] for t in ll], subsets, n)]
    return BackendCosts(one[0], block[0], one[1], block[1], invariant, torch.get_num_threads(),
                        TIMED_LAYERS if cut else 0, n if cut else 0)


def timed_subsets(n_layers: int) -> list[list[int]]:
    """The layers a big file is timed on: every other one of TIMED_LAYERS spread evenly over its n_layers, then all
    TIMED_LAYERS (the first a subset of the second; TIMED_LAYERS >= 2)."""
    if TIMED_LAYERS < 2:
        raise ValueError(f"TIMED_LAYERS must be at least 2 (two subsets of different sizes), got {TIMED_LAYERS}")
    spread = [i * n_layers // TIMED_LAYERS for i in range(TIMED_LAYERS)]
    return [spread[::2], spread]


def whole_ms(ms: list[float], subsets: list, n_layers: int) -> float:
    """A whole forward's ms from forwards over `subsets` (timed_subsets; [None]: the whole model, as is): the
    larger subset's time plus the per-layer slope between the two for each layer it left out (a slope below 0,
    noise, counts as 0)."""
    if subsets == [None]:
        return ms[0]
    (a, b), (ta, tb) = (len(subsets[0]), len(subsets[1])), ms
    return tb + (n_layers - b) * max(0.0, tb - ta) / (b - a)


def llamacpp_invariant(path: str) -> bool:
    """libllama's batch-invariance check for the file: from the start-up cache when libllama ran it here before,
    else measured on a load of the file (and kept there)."""
    from .llamacpp.model import LlamaCppLM, known_batch_variance

    variance = known_batch_variance(path)
    return variance == 0.0 if variance is not None else LlamaCppLM(path).batch_invariant


def cached_costs(path: str, load_kernel, check_invariance: bool = True) -> BackendCosts:
    """measure(path, load_kernel), or its result from the start-up cache (--recalibrate measures again).
    check_invariance: the entry must hold libllama's batch-invariance check (a speculating method's choice reads
    it); an entry written for plain decoding gets it added."""
    from .. import startup_cache

    key = startup_cache.key("backend-costs", startup_cache.file_identity(path), torch.get_num_threads(), BLOCK, CTX,
                            startup_cache.code_identity(__file__))
    hit = startup_cache.read_json("backend-costs", key)
    costs = None
    if hit is not None:
        try:
            costs = BackendCosts(**hit)
        except TypeError:
            pass
    if costs is not None and (costs.llamacpp_invariant is not None or not check_invariance):
        return costs
    if costs is not None:
        costs = replace(costs, llamacpp_invariant=llamacpp_invariant(path))
    else:
        costs = measure(path, load_kernel, check_invariance)
    startup_cache.write_json("backend-costs", key, asdict(costs))
    log.info("backend costs of %s: %s", path, costs)
    return costs

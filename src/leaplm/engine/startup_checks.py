"""The engine's start-up measurements (the cost calibration, the thread check), kept per machine, model files,
thread count and configuration in the start-up cache (startup_cache.py), so a second start on the same machine
measures nothing: its costs are the first start's until live steps refresh them (kpolicy/costs.py: every forward
refreshes its level). `--recalibrate` measures again.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from .. import startup_cache
from .kpolicy import calibrate as calibrate_module
from .kpolicy import costs as costs_module
from .kpolicy.calibrate import calibrate, layer_subset

log = logging.getLogger(__name__)

# torch's threads are slower than one when one forward at them takes this many times the one-thread forward
CONTENDED = 1.3
THREAD_CHECK_BUDGET_S = 0.5      # the thread check stops early past this (a contended one is slow)


def _identity(engine) -> list:
    """What the measurements depend on besides the machine: the model files, how they run, threads, K."""
    def ident(lm) -> str:
        if lm is None:
            return "-"
        try:
            return startup_cache.model_identity(lm.path)
        except OSError:
            return f"unhashable:{lm.path}"

    model = engine.model
    quant = sorted({q.backend for q in model.quantized.values()})   # QuantizedLinear / SplitLinear
    return [ident(engine.target), ident(engine.draft), engine.backend, str(model.dtype),
            quant, torch.get_num_threads(), engine.spec.method, engine.spec.k, engine.max_model_len,
            _draft_forward(engine), _kernel(engine)]


def _kernel(engine) -> str:
    """The int8 kernel's build, path and tile sizes where a model runs on it: a faster kernel changes every block
    cost, so costs measured with another build are not this one's."""
    models = [engine.model] + ([engine.draft.model] if engine.draft is not None else [])
    if not any(q.backend == "extension" for m in models for q in m.quantized.values()):
        return "-"
    from ..kernels.build import built_library, load

    ext = load()
    return f"{built_library().tag}/{ext.path if ext else '-'}/{ext.amx_tokens if ext else '-'}"


def _draft_forward(engine) -> str:
    """What runs the draft's forward: its cost per drafted token is measured here, and differs severalfold."""
    from ..models.draft_vocab import VocabMappedDraft
    from ..models.llama import LlamaForCausalLM

    draft = engine.draft.model if engine.draft is not None else None
    if isinstance(draft, VocabMappedDraft):
        draft = draft.inner
    if isinstance(draft, LlamaForCausalLM) and draft.one_call and draft.one_call_forward() is not None:
        return "one-call"
    return "-"


def cached_calibrate(engine, max_rows: int = 1, ctx: int = 256, repeats: int = 2) -> bool:
    """calibrate(), or its result from the cache; True when it came from the cache."""
    if calibration_from_cache(engine, max_rows, ctx, repeats):
        return True
    calibrate(engine, max_rows, ctx, repeats)
    startup_cache.write_json("calibration", _calibration_key(engine, max_rows, ctx, repeats),
                             _snapshot(engine.estimates))
    return False


def calibration_from_cache(engine, max_rows: int = 1, ctx: int = 256, repeats: int = 2) -> bool:
    """Restore calibrate()'s result from the start-up cache, measuring nothing; False when it holds none."""
    hit = startup_cache.read_json("calibration", _calibration_key(engine, max_rows, ctx, repeats))
    if hit is None:
        return False
    try:
        _restore(engine.estimates, hit)
        return True
    except (KeyError, TypeError, ValueError) as e:
        log.info("start-up cache: calibration entry unreadable (%s); measuring", e)
        return False


def _code() -> str:
    """The measuring code's identity: the calibration loop, the cost model it fills, and this module."""
    return startup_cache.code_identity(calibrate_module.__file__, costs_module.__file__, __file__)


def _calibration_key(engine, max_rows: int, ctx: int, repeats: int) -> str:
    return startup_cache.key("calibration", *_identity(engine), max_rows, ctx, repeats, _code())


def _snapshot(est) -> dict:
    c = est.costs
    return {"level": [[n, v] for n, v in c.level.items()], "ref": [[n, v] for n, v in c.ref.items()],
            "shape": [[n, T, v] for (n, T), v in c.shape.items()],
            "weight": [[n, T, v] for (n, T), v in c.weight.items()],
            "calibrated_rows": sorted(est.calibrated_rows),
            "draft_prefill_s_per_token": est.draft_prefill_s_per_token,
            "propose_s": est.propose_s, "propose_s_rows": [[m, n, v] for (m, n), v in est.propose_s_rows.items()]}


def _restore(est, d: dict) -> None:
    c = est.costs
    c.level.update({int(n): float(v) for n, v in d["level"]})
    c.ref.update({int(n): int(v) for n, v in d["ref"]})
    c.shape.update({(int(n), int(T)): float(v) for n, T, v in d["shape"]})
    c.weight.update({(int(n), int(T)): float(v) for n, T, v in d["weight"]})
    est.calibrated_rows.update(int(n) for n in d["calibrated_rows"])
    est.draft_prefill_s_per_token = float(d["draft_prefill_s_per_token"])
    est.propose_s.update({m: float(v) for m, v in d["propose_s"].items()})
    est.propose_s_rows.update({(m, int(n)): float(v) for m, n, v in d["propose_s_rows"]})


def cached_check_threads(engine) -> ThreadCheck | None:
    """check_threads(), or its last result on this machine for this model and thread count (its warning is
    logged again either way)."""
    model = engine.model
    llama = engine.backend == "llamacpp"
    n = (model.threads or torch.get_num_threads()) if llama else torch.get_num_threads()
    if n <= 1 or engine.backend not in ("torch", "llamacpp") or str(model.device) != "cpu":
        return None
    k = startup_cache.key("threads", *_identity(engine)[:5], n, _code())
    hit = startup_cache.read_json("threads", k)
    if hit is not None:
        try:
            check = ThreadCheck(int(hit["threads"]), float(hit["s_threads"]), float(hit["s_one"]))
            if check.contended:
                log.warning("%s's %d threads ran a one-token forward in %.1f ms, one thread in %.1f ms when last "
                            "measured here: --threads 1 (or the number of idle cores) is faster and steadier "
                            "(--recalibrate measures again)", "libllama" if llama else "torch", n,
                            1e3 * check.s_threads, 1e3 * check.s_one)
            return check
        except (KeyError, TypeError, ValueError):
            pass
    check = check_threads(engine)
    if check is not None:
        startup_cache.write_json("threads", k, {"threads": check.threads, "s_threads": check.s_threads,
                                                "s_one": check.s_one})
    return check


@dataclass(frozen=True)
class ThreadCheck:
    """A one-token forward at torch's thread count against the same forward at one thread (the median of a few:
    what a run will see, interference included)."""
    threads: int
    s_threads: float              # seconds per one-token forward at `threads`
    s_one: float                  # ... at one thread

    @property
    def contended(self) -> bool:
        """More threads run slower than one: other processes hold the cores some of them wait for."""
        return self.s_threads > CONTENDED * self.s_one


def check_threads(engine, tries: int = 6, budget_s: float = THREAD_CHECK_BUDGET_S) -> ThreadCheck | None:
    """On a CPU whose cores are partly held by other work, an engine's default threads (one per core) wait for each
    other at every kernel: on 2 cores with one running a training job, the embedded target's one-token forward
    took 40-100 ms at 2 threads and 12 ms at 1 on torch, and block forwards varied 1x-10x, so the cost calibration
    and the K policy's choices changed from run to run; libllama's threads spin at each of a forward's barriers
    while the other is descheduled (SmolLM2 beside one busy process: 0.4 tokens/s at 2 threads, 140 at 1). This
    measures it (up to `tries` one-token forwards at each count, interleaved, fewer once two of each took more than
    budget_s; the setting is restored) and warns with the remedy. None: one thread, or not a CPU engine."""
    model = engine.model
    if engine.backend not in ("torch", "llamacpp") or str(model.device) != "cpu":
        return None
    llama = engine.backend == "llamacpp"
    n = (model.threads or torch.get_num_threads()) if llama else torch.get_num_threads()
    if n <= 1:
        return None
    ctx = max(1, min(64, engine.max_model_len // 2))
    cache = model.new_cache(1, ctx + 2)
    x = torch.zeros(1, 1, dtype=torch.long)
    sub = layer_subset(model)      # the ratio of the two thread counts is what matters; times scaled to a forward
    if llama:                      # libllama writes a row's cells in order: a real context before the timed token
        model(torch.zeros(1, ctx, dtype=torch.long), cache, last_only=True)
    set_threads = cache.set_threads if llama else torch.set_num_threads
    times: dict[int, list[float]] = {n: [], 1: []}
    start = time.perf_counter()
    try:
        for j in range(tries + 1):
            for t in ((n, 1) if j % 2 == 0 else (1, n)):
                set_threads(t)
                cache.lengths[:1] = [ctx]
                t0 = time.perf_counter()
                model(x, cache, **sub.kwargs)
                s = sub.scale * (time.perf_counter() - t0)
                if j:                                    # the first forward at a thread count is its warm-up
                    times[t].append(s)
            if j >= 2 and time.perf_counter() - start > budget_s:
                break
    finally:
        set_threads(n)
    check = ThreadCheck(n, statistics.median(times[n]), statistics.median(times[1]))
    if check.contended:
        log.warning("%s's %d threads run a one-token forward in %.1f ms, one thread in %.1f ms: other processes "
                    "hold some of the cores, so speeds (and the adaptive K's choices) vary from run to run; "
                    "--threads 1 (or the number of idle cores) is faster and steadier here",
                    "libllama" if llama else "torch", n, 1e3 * check.s_threads, 1e3 * check.s_one)
    return check

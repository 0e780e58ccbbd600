"""The engine's start-up measurements (the cost calibration, the thread check), kept per machine, model files,
thread count and configuration in the start-up cache (startup_cache.py), so a second start on the same machine
measures nothing: its costs are the first start's until live steps refresh them (kpolicy/costs.py: every forward
refreshes its level). `--recalibrate` measures again.
"""
from __future__ import annotations

import logging

import torch

from .. import startup_cache
from .kpolicy import calibrate as calibrate_module, costs as costs_module
from .kpolicy.calibrate import ThreadCheck, calibrate, check_threads

log = logging.getLogger(__name__)


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

"""The one cost calibration of an engine: batched target forward costs and a draft model's costs, measured at
start-up (live steps keep refreshing them; engine/kpolicy/costs.py). The thread check, the other start-up
measurement, is engine/startup_checks.py's."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...models import backend_costs
from .estimates import Estimates, rows_bucket

# Rounds of every block length at start-up: at least `repeats`, then up to ROUNDS while they take less than
# ROUNDS_BUDGET_S in all (per row count). The cost model keeps each length's fastest time (costs.calibrated says
# why): on a busy machine a few more rounds are what makes it meet a quiet moment.
ROUNDS = 8
ROUNDS_BUDGET_S = 2.0
# Block lengths measured beyond K + 1 at up to LONG_ROWS rows: a row with a prediction drafts up to 32 tokens
# (propose/prediction.py), and its K is chosen from what these blocks cost (a CPU forward over 33 tokens costs a
# few times one token's, far less than the 33 / 6 times a linear extrapolation from K + 1 = 6 would price it)
LONG_BLOCKS = (9, 17, 33)
LONG_ROWS = 2


def calibrate(engine, max_rows: int = 1, ctx: int = 256, repeats: int = 2) -> None:
    """The one cost calibration: batched forward costs at n in 1, 2, 4, ... max_rows rows and T = 1 .. K + 1
    tokens (live steps keep refreshing them), a draft model's prefill cost per token and its one-token forward
    (the prior of the draft's cost per drafted token). Sizes already measured on this engine are skipped."""
    est: Estimates = engine.estimates
    model = engine.model
    ctx = max(1, min(ctx, engine.max_model_len // 2))
    k = engine.spec.k
    ns = sorted({min(max_rows, 1 << i) for i in range(max_rows.bit_length() + 1)} - est.calibrated_rows)
    dev = model.device
    if ns:
        cache = model.new_cache(max(ns), engine.max_model_len)
        top = engine.max_model_len - ctx
        short = list(range(1, min(k + 1, top) + 1))
        sub = layer_subset(model)
        for n in ns:
            Ts = short + ([T for T in LONG_BLOCKS if k + 1 < T <= top] if n <= LONG_ROWS else [])
            cache.lengths[:n] = [ctx] * n
            forward = lambda T: model(torch.zeros(n, T, dtype=torch.long, device=dev), cache,  # noqa: E731
                                      **sub.kwargs)
            forward(Ts[-1])                              # warm-up: the first forward of a shape is not its cost
            # rounds of every T back to back, the order reversed every other round (a trend in the machine's
            # speed within a round cancels); the cost model keeps each T's fastest time (shape) and the median of
            # the smallest T's (level)
            rounds: list[dict[int, float]] = []
            t_start = time.perf_counter()
            while len(rounds) < max(2, repeats) or (len(rounds) < ROUNDS
                                                     and time.perf_counter() - t_start < ROUNDS_BUDGET_S):
                j = len(rounds)
                rounds.append({T: sub.scale * _timed(lambda: forward(T)) for T in (Ts if j % 2 == 0 else Ts[::-1])})
            est.costs.calibrated(n, rounds)
            cache.lengths[:n] = [0] * n
        est.calibrated_rows.update(ns)
    if engine.draft is not None and not est.draft_prefill_s_per_token:
        draft = engine.draft.model
        n_tok = max(1, min(ctx, draft.max_len - 2))
        cache = draft.new_cache(1, n_tok + 1)
        best = one = float("inf")
        for _ in range(repeats + 1):
            cache.lengths[0] = 0
            t = time.perf_counter()
            draft(torch.zeros(1, n_tok, dtype=torch.long, device=draft.device), cache, last_only=True)
            best = min(best, time.perf_counter() - t)
            cache.lengths[0] = n_tok
            t = time.perf_counter()
            draft(torch.zeros(1, 1, dtype=torch.long, device=draft.device), cache, last_only=True)
            one = min(one, time.perf_counter() - t)
        est.draft_prefill_s_per_token = best / n_tok
        est.propose_s.setdefault("draft", one)
    if engine.draft is not None:
        # the draft's one-token forward over n rows at once (a batch's draft rows draft together): per drafted token
        draft = engine.draft.model
        n_ctx = max(1, min(ctx, draft.max_len - 2))
        todo = [n for n in sorted({min(max_rows, 1 << i) for i in range(max_rows.bit_length() + 1)})
                if ("draft", rows_bucket(n)) not in est.propose_s_rows]
        if todo and (max(todo) == 1 or draft.capabilities.batch):
            cache = draft.new_cache(max(todo), n_ctx + 1)
            for n in todo:
                cache.lengths[:n] = [n_ctx] * n
                best = min(_timed(lambda: draft(torch.zeros(n, 1, dtype=torch.long, device=draft.device), cache,
                                                last_only=True)) for _ in range(repeats + 1))
                est.propose_s_rows[("draft", rows_bucket(n))] = best / n


@dataclass(frozen=True)
class LayerSubset:
    """What a start-up timing runs of a model: its first layers (kwargs for its forward) and the factor from their
    time to the whole forward's."""
    kwargs: dict
    scale: float                  # the whole forward's linear weight bytes over those of the layers run and the head
    layers: int | None            # the layers run; None: all


def layer_subset(model) -> LayerSubset:
    """A quantized model that runs layer subsets, of more decoder layers and more linear weight bytes than
    --backend auto's timing bounds (models/backend_costs.py: TIMED_LAYERS, TIMED_BYTES), is timed on its first
    TIMED_LAYERS: every layer has the same shapes, and a forward of a few tokens reads its weights once, so its time
    scales with the weight bytes read (the output projection's included: on a 128k-token vocabulary it is a fifth
    of a 1B model's bytes). Others are timed whole (scale 1): in a few layers the head and each forward's fixed
    costs weigh more than in the model."""
    q = model.quantized
    n = backend_costs.TIMED_LAYERS
    if not q or not model.capabilities.layer_subsets or model.num_layers <= n:
        return LayerSubset({}, 1.0, None)
    whole = sum(lin.nbytes for lin in q.values())
    if whole <= backend_costs.TIMED_BYTES:
        return LayerSubset({}, 1.0, None)

    def layer(name: str) -> int | None:
        return int(name.split(".")[1]) if name.startswith("layers.") else None

    run = sum(lin.nbytes for name, lin in q.items() if (layer(name) or 0) < n)
    return LayerSubset({"layers": range(n)}, whole / run, n)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t

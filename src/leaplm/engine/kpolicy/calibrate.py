"""The one cost calibration of an engine: batched target forward costs and a draft model's costs, measured at
start-up (live steps keep refreshing them; engine/kpolicy/costs.py)."""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

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
# torch's threads are slower than one when one forward at them takes this many times the one-thread forward
CONTENDED = 1.3
THREAD_CHECK_BUDGET_S = 0.5      # the thread check stops early past this (a contended one is slow)

log = logging.getLogger(__name__)


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
        for n in ns:
            Ts = short + ([T for T in LONG_BLOCKS if k + 1 < T <= top] if n <= LONG_ROWS else [])
            cache.lengths[:n] = [ctx] * n
            forward = lambda T: model(torch.zeros(n, T, dtype=torch.long, device=dev), cache)  # noqa: E731
            forward(Ts[-1])                              # warm-up: the first forward of a shape is not its cost
            # rounds of every T back to back, the order reversed every other round (a trend in the machine's
            # speed within a round cancels); the cost model keeps each T's fastest time (shape) and the median of
            # the smallest T's (level)
            rounds: list[dict[int, float]] = []
            t_start = time.perf_counter()
            while len(rounds) < max(2, repeats) or (len(rounds) < ROUNDS
                                                     and time.perf_counter() - t_start < ROUNDS_BUDGET_S):
                j = len(rounds)
                rounds.append({T: _timed(lambda: forward(T)) for T in (Ts if j % 2 == 0 else Ts[::-1])})
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


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


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
                s = _timed(lambda: model(x, cache))
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

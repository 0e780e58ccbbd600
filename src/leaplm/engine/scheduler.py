"""Continuous batching for the server: a queue, a thread and admission around one engine/step.py Batch.

Requests join the batch between steps (admission: a free row), and leave when they finish, fail or are aborted;
the step itself (propose, score, verify, commit, the K policy, calibration) is the engine's one step, the same
that Engine.generate runs as a batch of one.

Threading: the loop runs in one background thread (start/stop). submit() and abort() may be called from any
thread; outputs go back through each request's on_output callback, called from the loop thread, and once a step's
outputs are all out, `on_step_outputs` (when set) is called once: the server collects a step's outputs in its
sinks and hands them to its event loop in that one call (one thread handoff per step, whatever the number of
rows). An abort is honoured at the next step boundary, where the row is freed.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..config import ConfigError, SamplingParams
from .prepare import PreparedRequest
from .startup_checks import cached_calibrate, calibration_from_cache
from .request import StreamChunk, TokenLogprob
from .row import engine_error
from .step import Batch, Row, StepReport, prompt_token_logprobs  # noqa: F401  (StepReport: re-exported)

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests are waiting than the scheduler's max_queue allows."""


class SchedulerClosed(RuntimeError):
    """The scheduler is stopping (or stopped) and takes no new requests."""


_ids = itertools.count()


@dataclass
class SeqRequest:
    """One sequence to generate, as a caller hands it to the scheduler: a PreparedRequest (engine/prepare.py, what
    the server submits), or its parts, prepared by the scheduler when the sequence is admitted."""
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[["SeqOutput"], None]     # called from the scheduler thread
    method: str | None = None                    # proposer method; None = the scheduler's, "none" = no drafts
    k: int | None = None                         # most tokens drafted per step; None = the scheduler's K
    adaptive_k: bool | None = None               # False: draft k every step; None = the engine's setting
    prompt_logprobs: int | None = None           # return prompt-token logprobs with this many alternatives
    request_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    aborted: bool = False                        # set through BatchScheduler.abort, honoured at a step boundary
    abort_reason: str | None = None
    prepared: PreparedRequest | None = None      # the request as it runs (set: the fields above are its parts)

    @classmethod
    def prepared_as(cls, req: PreparedRequest, on_output: Callable[["SeqOutput"], None]) -> "SeqRequest":
        return cls(req.ids, req.params, on_output, req.method, req.k, req.adaptive_k, req.prompt_logprobs,
                   prepared=req)


@dataclass
class SeqOutput:
    """What one step produced for one request: a chunk, or an error that ended it."""
    request_id: str
    chunk: StreamChunk | None = None             # finish_reason and stats set on the last chunk
    error: str | None = None                     # set when the request ended without finishing
    prompt_logprobs: list[TokenLogprob | None] | None = None   # first output only; position 0 has none
    time: float = field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.chunk is not None and self.chunk.finish_reason is not None)


class BatchScheduler:
    """A queue, a thread and admission around one Batch of max_batch rows (see the module docstring).

    engine: a leaplm Engine (its target, draft, tokenizer, SpecConfig, proposer factories and estimates are used;
    its own batch of one is not). observer: optional object with on_step(StepReport), called per step.
    """

    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64, observer=None,
                 calibrate: bool | str = True):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError("max_batch", f"must be an integer >= 1, got {max_batch!r}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ConfigError("max_queue", f"must be an integer >= 0, got {max_queue!r}")
        self.engine = engine
        self.model = engine.model
        if max_batch > 1 and not self.model.capabilities.batch:
            raise ConfigError("max_batch", f"{type(self.model).__name__} runs one sequence at a time; "
                                           "use max_batch 1 with this model")
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_len = engine.max_model_len
        self.observer = observer
        self.on_step_outputs: Callable[[], None] | None = None    # called once after each step's outputs
        self.batch = Batch(engine, max_batch)
        self._waiting: deque[SeqRequest] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        # (KV cells, sequences holding any) per cache, as the backend counts them (cache.held(): libllama is asked
        # for the llama.cpp caches), counted in the loop thread whenever rows join or leave: libllama's memory may
        # not be read while a decode runs, so /metrics reads this
        self.held: dict[str, tuple[int, int]] = {"target": (0, 0), "draft": (0, 0)}
        # row counts the loop thread still has to calibrate, smallest first, while nothing waits or runs
        self.pending_calibration: list[int] = []
        if calibrate == "idle":
            self.calibrate_when_idle()
        elif calibrate:                                  # also without a default method: requests may ask for one
            self.calibrate()

    # --- any thread ----------------------------------------------------------------------------------------
    @property
    def cache(self):
        return self.batch.cache

    @property
    def draft_prefill_s_per_token(self) -> float:
        return self.engine.estimates.draft_prefill_s_per_token

    @property
    def _running(self) -> list[Row]:
        return self.batch.rows

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def admits_next(self) -> bool:
        """Requests wait and a row is free: the next step admits one (and prefills its prompt)."""
        return bool(self._waiting) and not self.batch.full

    @property
    def running(self) -> int:
        return len(self.batch.rows)

    @property
    def sequences_in_flight(self) -> int:
        """Sequences waiting or running (what a queue limit counted in sequences, running ones included, uses)."""
        with self._cond:
            return len(self._waiting) + len(self._running)

    @property
    def rows_in_use(self) -> int:
        """Cache rows holding tokens (running rows; a freed row is reset to length 0)."""
        return sum(1 for n in self.cache.lengths if n > 0)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cache.lengths)

    def submit(self, seqs: list[SeqRequest]) -> None:
        """Queue sequences (all or none). Raises QueueFull over max_queue, SchedulerClosed when stopping."""
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is shutting down")
            if len(self._waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
            self._waiting.extend(seqs)
            self._cond.notify()

    def abort(self, seq: SeqRequest, reason: str | None = None) -> None:
        """Mark seq aborted; the loop drops it (and frees its row) at the next step boundary."""
        seq.abort_reason = reason or "aborted"
        seq.aborted = True
        with self._cond:
            self._cond.notify()

    def abort_all(self, reason: str) -> None:
        with self._cond:
            for seq in list(self._waiting):
                self.abort(seq, reason)
            for row in list(self.batch.rows):
                self.abort(row.tag, reason)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self.batch.rows

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="leaplm-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, abort the rest, and end the loop thread."""
        with self._cond:
            self._closed = True
        self.abort_all("the server is shutting down")
        with self._cond:
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def close_admission(self) -> None:
        with self._cond:
            self._closed = True

    # --- loop thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self.batch.rows and not self._closed and \
                        not self.pending_calibration:
                    self._cond.wait()
                if self._closed and not self._waiting and not self.batch.rows:
                    return
                calibrating = not self._waiting and not self.batch.rows and self.pending_calibration
            if calibrating:
                self._calibrate_next()
                continue
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                log.exception("engine step failed")
                for i in reversed(range(len(self.batch.rows))):
                    self._release(i, error=engine_error(e))
                self.count_held()
                self._outputs_done()

    def step(self) -> bool:
        """Drop aborted requests, admit waiting ones, then run the one step over all rows.
        Returns False when there was nothing to run."""
        try:
            return self._step()
        finally:
            self._outputs_done()

    def _outputs_done(self) -> None:
        if self.on_step_outputs is not None:
            try:
                self.on_step_outputs()
            except Exception:  # noqa: BLE001 - a listener's failure is its own
                log.exception("on_step_outputs failed")

    def _step(self) -> bool:
        before = [id(r) for r in self.batch.rows]
        self._reap()
        self._admit()
        outcome = self.batch.step()
        if [id(r) for r in self.batch.rows] != before:      # rows joined or left: what the backends hold moved
            self.count_held()
        if outcome is None:
            return False
        for out in outcome.outputs:
            seq: SeqRequest = out.row.tag
            if out.error is not None:
                self._emit(seq, SeqOutput(seq.request_id, error=out.error))
            elif out.chunk is not None and (out.chunk.text or out.chunk.token_ids or out.chunk.finish_reason):
                self._emit(seq, SeqOutput(seq.request_id, out.chunk, time=outcome.time))
        if self.observer is not None and outcome.report is not None:
            self.observer.on_step(outcome.report)
        return True

    def count_held(self) -> None:
        """Count what the caches hold (self.held) from their backends; loop thread only, between steps."""
        from ..propose.draft_model import DraftRows

        drafts = [g.cache.held() for g in self.batch.groups.values() if isinstance(g, DraftRows)]
        self.held = {"target": self.cache.held(),
                     "draft": (sum(c for c, _ in drafts), sum(s for _, s in drafts))}

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step in the calling thread until nothing is waiting or running (tests, offline batches)."""
        for _ in range(max_steps):
            busy = self.step()
            if not busy and not self._waiting:
                return
        raise RuntimeError(f"not idle after {max_steps} steps")

    # --- joining and leaving ----------------------------------------------------------------------------------
    def _reap(self) -> None:
        for i in reversed(range(len(self.batch.rows))):
            seq = self.batch.rows[i].tag
            if seq.aborted:
                self._release(i, error=seq.abort_reason or "aborted")

    def _admit(self) -> None:
        while not self.batch.full:
            with self._cond:
                if not self._waiting:
                    return
                seq = self._waiting.popleft()
            if seq.aborted:
                self._emit(seq, SeqOutput(seq.request_id, error=seq.abort_reason or "aborted"))
                continue
            try:
                req = seq.prepared or self.engine.prepare(seq.prompt_ids, seq.params, method=seq.method, k=seq.k,
                                                          adaptive_k=seq.adaptive_k,
                                                          prompt_logprobs=seq.prompt_logprobs)
                _, prompt_lps = self.batch.join(req.ids, req.params, req.method, req.k, req.prompt_logprobs,
                                                tag=seq, adaptive_k=req.adaptive_k)
            except Exception as e:  # noqa: BLE001 - a request that cannot start fails alone
                log.exception("request %s could not start", seq.request_id)
                self._emit(seq, SeqOutput(seq.request_id, error=f"could not start: {engine_error(e)}"))
                continue
            if prompt_lps is not None:
                self._emit(seq, SeqOutput(seq.request_id, StreamChunk("", []), prompt_logprobs=prompt_lps))

    def _release(self, i: int, error: str) -> None:
        """Remove running row i, its request ending with `error`."""
        seq = self.batch.remove(i).tag
        self._emit(seq, SeqOutput(seq.request_id, error=error))

    @staticmethod
    def _emit(seq: SeqRequest, out: SeqOutput) -> None:
        try:
            seq.on_output(out)
        except Exception:  # noqa: BLE001 - a listener's failure is its own
            log.exception("on_output of %s failed", seq.request_id)

    def calibrate(self, ctx: int = 256, repeats: int = 2) -> None:
        """The engine's one cost calibration, extended to this scheduler's batch sizes (before serving)."""
        if self.batch.rows:
            raise RuntimeError("calibrate() before serving requests")
        cached_calibrate(self.engine, self.max_batch, ctx, repeats)

    def calibrate_when_idle(self) -> None:
        """calibrate() from the start-up cache now if it holds it; else the loop thread measures one batch size at a
        time (1, 2, 4, ... max_batch rows, each a second or two) whenever no request waits or runs, so a server
        answers from its first second. Until a size is measured, a step of that many rows is priced from the sizes
        measured so far (kpolicy/costs.py: interpolated; none yet: a block of T tokens costs T one-token
        forwards, so nothing is drafted)."""
        if calibration_from_cache(self.engine, self.max_batch):
            return
        sizes = sorted({min(self.max_batch, 1 << i) for i in range(self.max_batch.bit_length() + 1)})
        self.pending_calibration = [n for n in sizes if n not in self.engine.estimates.calibrated_rows] or \
            [self.max_batch]                             # the last size also writes the start-up cache entry

    def _calibrate_next(self) -> None:
        """Measure the next pending batch size (loop thread, nothing waiting or running)."""
        n = self.pending_calibration[0]
        try:
            cached_calibrate(self.engine, n)
        except Exception:  # noqa: BLE001 - a failed measurement leaves the live steps to price the costs
            log.exception("calibrating %d rows failed; live steps price the costs", n)
        self.pending_calibration.pop(0)
        if not self.pending_calibration:
            log.info("cost calibration done (1 to %d rows)", self.max_batch)

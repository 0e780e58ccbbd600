"""The bridge between the scheduler's thread and asyncio: one Job per HTTP request submits its sequences
(admission first: 400 never fits, 429 not now), and carries what the scheduler thread produces into an
asyncio.Queue the request's handler reads. The handoff is once per step: each sequence's sink puts its output in
the Mailbox, and at the end of the step (BatchScheduler.on_step_outputs) one wake-up of the event loop hands every
output of the step over, however many rows ran (handoff.py). A watcher waits for the client's http.disconnect;
when it comes, every sequence of the request is aborted and the scheduler frees their rows at its next step
boundary."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request

from ..engine.scheduler import QueueFull, SchedulerClosed, SeqOutput, SeqRequest
from ..engine.row import GRAMMAR_ERROR
from ..engine.stats import GenerationStats
from .handoff import Mailbox
from .planning import Plan
from .protocol import APIError
from .state import ServerState
from .streaming import usage


@dataclass
class SeqResult:
    """What came back for one sequence (asyncio thread only)."""
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    error: str | None = None
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0


class Job:
    """One HTTP request: its sequences in the scheduler and what came back for them."""

    DISCONNECTED = object()

    def __init__(self, state: ServerState, plan: Plan):
        self.state, self.plan = state, plan
        self.prompts, self.n = plan.prompts, plan.n
        self.loop = asyncio.get_running_loop()          # built on the event loop (see app.py)
        self.mailbox: Mailbox = state.mailbox
        self.mailbox.bind(self.loop)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.seqs = [SeqRequest.prepared_as(req, self._sink(i)) for i, req in enumerate(plan.requests)]
        self.results = [SeqResult() for _ in self.seqs]
        # KV-cache tokens each sequence may grow to, reserved from the admission budget until it finishes
        self.reservations = [len(req.prompt_ids) + req.params.max_new_tokens for req in plan.requests]
        self.released = [True] * len(self.seqs)     # set False once reserved
        self.open = len(self.seqs)                  # sequences not finished yet
        self.usage_chunk: dict | None = None        # a stream's last chunk with include_usage, set at its end

    def _sink(self, i: int):
        mailbox = self.mailbox

        started = False                         # the sequence's first token has been put

        def put(out: SeqOutput) -> None:          # scheduler thread
            nonlocal started
            if out.finished and not self.released[i]:
                self.released[i] = True
                self.state.admission.release(self.reservations[i])
            first = not started and out.chunk is not None and bool(out.chunk.token_ids)
            started = started or first
            mailbox.put(self, i, out, urgent=first or out.finished)     # never held (handoff.py)
        return put

    def submit(self) -> None:
        """Admit (admission.py: 400 never fits, 429 not now) and queue every sequence, or none."""
        sched, adm, plan = self.state.scheduler, self.state.admission, self.plan
        adm.check(sched.sequences_in_flight, self.reservations, [len(p.ids) for p in self.prompts], plan.max_tokens,
                  plan.max_field, plan.prompt_field, plan.n)
        adm.reserve(sum(self.reservations))
        self.released = [False] * len(self.seqs)
        try:
            sched.submit(self.seqs)
        except (QueueFull, SchedulerClosed) as e:
            self.released = [True] * len(self.seqs)
            adm.unreserve(sum(self.reservations))
            if isinstance(e, SchedulerClosed):
                raise APIError(503, "server is shutting down", None, "shutting_down") from None
            raise APIError(429, f"server busy: {e}; retry later", None, "queue_full",
                           {"Retry-After": str(adm.drain.retry_after(sequences=len(self.seqs)))}) from None
        self.state.metrics.prompt_tokens.inc(sum(len(p.ids) for p in self.prompts) * self.n)

    def abort(self, reason: str = "client disconnected") -> None:
        """Abort every sequence still running (counted as finish reason 'abort'); later outputs are ignored."""
        for seq, res in zip(self.seqs, self.results):
            if res.finish_reason is None and res.error is None:
                self.state.scheduler.abort(seq, reason)
                res.error = reason
                self.state.metrics.finished.labels("abort").inc()

    async def watch(self, request: Request) -> None:
        """Wait for the client to go away, then wake the consumer."""
        try:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    break
        except Exception:  # noqa: BLE001 - a broken channel is a disconnect too
            pass
        self.queue.put_nowait((None, self.DISCONNECTED))

    async def next(self):
        """(index, SeqOutput) of the next output, or None when the client disconnected."""
        i, out = await self.queue.get()
        if out is self.DISCONNECTED:
            return None
        self._record(i, out)
        return i, out

    async def next_outputs(self):
        """Every (index, SeqOutput) that has come back (waiting for the first), each recorded as the iteration
        reaches it, or None when the client disconnected: a stream writes a step's chunks of all its choices at
        once."""
        got = [await self.queue.get()]
        while not self.queue.empty():
            got.append(self.queue.get_nowait())
        if any(out is self.DISCONNECTED for _, out in got):
            return None
        return self._recorded(got)

    def _recorded(self, got: list):
        for i, out in got:
            self._record(i, out)
            yield i, out

    def _record(self, i: int, out: SeqOutput) -> None:
        res, m = self.results[i], self.state.metrics
        if res.error is not None:               # aborted here already: whatever was in flight does not count
            return
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = out.prompt_logprobs
        c = out.chunk
        if c is not None:
            res.text.append(c.text)
            if c.logprobs:
                res.logprobs.extend(c.logprobs)
            if c.token_ids:
                res.token_ids.extend(c.token_ids)
                if res.first_at is None:
                    m.ttft.observe(out.time - self.arrival)
                    res.first_at = out.time
                else:
                    gap = (out.time - res.last_at) / len(c.token_ids)
                    for _ in c.token_ids:
                        m.itl.observe(gap)
                res.last_at = out.time
                res.tokens += len(c.token_ids)
            if c.finish_reason is not None:
                res.finish_reason, res.stats = c.finish_reason, c.stats
                if c.stats is not None:
                    m.accepted_prediction.inc(c.stats.accepted_prediction_tokens)
                    m.rejected_prediction.inc(c.stats.rejected_prediction_tokens)
                m.e2e.observe(out.time - self.arrival)
                m.finished.labels(c.finish_reason).inc()
        if out.error is not None:
            res.error = out.error
            m.finished.labels("abort" if "disconnect" in out.error or "shutting down" in out.error else "error").inc()
        if out.finished:
            self.open -= 1

    def failure(self) -> APIError | None:
        errors = [r.error for r in self.results if r.error is not None]
        if not errors:
            return None
        if self.state.draining:
            return APIError(503, f"server is shutting down: {errors[0]}", None, "shutting_down")
        if errors[0].startswith(GRAMMAR_ERROR):       # the request's own grammar failed while it ran
            field = self.plan.structured_field or "structured_outputs"
            return APIError(400, f"{field}: the grammar failed while generating ({errors[0][len(GRAMMAR_ERROR):]})",
                            field, "grammar_error")
        return APIError(500, errors[0], None, "engine_error")

    def usage(self) -> dict:
        return usage(sum(len(p.ids) for p in self.prompts), [r.stats for r in self.results if r.stats])

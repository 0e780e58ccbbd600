"""The scheduler thread's outputs handed to the event loop once per step.

Each sequence's sink (bridge.Job) puts its output here during a step; at the step's end the scheduler calls
`flush` (BatchScheduler.on_step_outputs), and one loop.call_soon_threadsafe moves every output of the step into
its Job's queue, whatever the number of rows: at most one wake-up of the event loop per step (none while one
is still pending), not one per row or token."""
from __future__ import annotations

import asyncio
from collections import deque


class Mailbox:
    """A step's outputs on their way from the scheduler's thread to the event loop."""

    def __init__(self):
        self.items: deque = deque()         # (job, sequence index, SeqOutput); deque appends are thread-safe
        self.loop: asyncio.AbstractEventLoop | None = None      # the server's event loop (set by the first Job)
        self.pending = False                # a delivery is scheduled and has not run: it will take what comes

    def put(self, job, i: int, out) -> None:     # scheduler thread, per sequence
        self.items.append((job, i, out))

    def flush(self) -> None:                # scheduler thread, once per step (BatchScheduler.on_step_outputs)
        if self.items and self.loop is not None and not self.pending:
            self.pending = True
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:            # the event loop is gone (shutdown)
                self.pending = False

    def _deliver(self) -> None:             # event loop
        self.pending = False                # from here on, a new output needs a new delivery
        items = self.items
        while items:
            job, i, out = items.popleft()
            job.queue.put_nowait((i, out))

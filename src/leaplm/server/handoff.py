"""The scheduler thread's outputs handed to the event loop once per step.

Each sequence's sink (bridge.Job) puts its output here during a step; at the step's end the scheduler calls
`flush` (BatchScheduler.on_step_outputs), and one loop.call_soon_threadsafe moves every output of the step into
its Job's queue, whatever the number of rows: at most one wake-up of the event loop per step (none while one
is still pending), not one per row or token.

The wake-up is sent by a thread of its own, not by the scheduler's. call_soon_threadsafe writes to the loop's
self-pipe, and that write lets go of the GIL: the event loop wakes, takes it, and the scheduler thread waits for
the loop's whole turn (the step's chunks serialized and written, about half a millisecond) before its next step
can start. `flush` only releases a lock, which keeps the GIL; the waker thread takes the GIL when the scheduler
thread lets it go, in the next step's forward (native code, run without the GIL), so the event loop's turn
overlaps the forward instead of adding to the step."""
from __future__ import annotations

import asyncio
import threading
from collections import deque


class Mailbox:
    """A step's outputs on their way from the scheduler's thread to the event loop."""

    def __init__(self):
        self.items: deque = deque()         # (job, sequence index, SeqOutput); deque appends are thread-safe
        self.loop: asyncio.AbstractEventLoop | None = None      # the server's event loop (set by the first Job)
        self.pending = False                # a delivery is signalled or scheduled and has not run: it takes what comes
        self._signal = threading.Lock()     # released by flush (one wake-up to send), taken by the waker thread
        self._signal.acquire()
        self._waker: threading.Thread | None = None

    def put(self, job, i: int, out) -> None:     # scheduler thread, per sequence
        self.items.append((job, i, out))

    def flush(self) -> None:                # scheduler thread, once per step (BatchScheduler.on_step_outputs)
        if self.items and self.loop is not None and not self.pending:
            self.pending = True
            if self._waker is None:
                self._waker = threading.Thread(target=self._wake_loop, name="leaplm-handoff", daemon=True)
                self._waker.start()
            self._signal.release()          # at most one release outstanding: pending stays set until _deliver

    def _wake_loop(self) -> None:           # waker thread
        while True:
            self._signal.acquire()
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

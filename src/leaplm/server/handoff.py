"""The scheduler thread's outputs handed to the event loop once per step.

Each sequence's sink (bridge.Job) puts its output here during a step; at the step's end the scheduler calls
`flush` (BatchScheduler.on_step_outputs), which wakes the event loop once, whatever the number of rows: at most
one wake-up per step (none while one is still pending), not one per row or token. The loop's turn (`_deliver`)
moves every output into its Job's queue.

The wake-up is one byte written to a pipe the loop watches, by libc's write called with the GIL held. A call that
let go of the GIL (os.write, socket.send, loop.call_soon_threadsafe) lets the woken loop take the GIL and the
scheduler thread wait for the loop's whole turn (the step's chunks serialized and written, about half a
millisecond on SmolLM2) before its next step can start; a thread of its own sending the wake-up costs a second
wake-up and a GIL handoff per step. Holding the GIL, the write returns at once; the loop takes the GIL when the
scheduler thread lets it go in the next step's forward (native code, run without the GIL), so the loop's turn
overlaps the forward instead of adding to the step.

Outputs may be held for a few steps (`interval_s`, the server's --stream-interval-ms): each wake-up of the loop and
each write to a client's socket costs the same CPU however many tokens it carries, and at a few milliseconds a
token that CPU is taken from the forwards. Held outputs go out at the end of the first step that ends at least
interval_s after the oldest of them was put, and at once when an output is urgent (a sequence's first token, its
end, an error: the first token's latency and the end of a request are never delayed) or a request waits for a
free row (the next step admits it and may prefill a long prompt). Each output stays an output of its own: a
stream writes the chunks of the outputs that came together in one write, the same chunks it writes one by one
with interval_s = 0."""
from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections import deque


def _write_holding_gil():
    """libc's write(fd, buf, n) through ctypes.PyDLL, whose calls keep the GIL; os.write where libc's symbols are
    not reachable that way (the wake-up is the same, the GIL goes during the call)."""
    try:
        fn = ctypes.PyDLL(None).write
    except (OSError, AttributeError, TypeError):
        return os.write
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t), ctypes.c_ssize_t
    return lambda fd, data: fn(fd, data, len(data))


_write = _write_holding_gil()


class Mailbox:
    """A step's outputs on their way from the scheduler's thread to the event loop."""

    def __init__(self, interval_s: float = 0.0, times=None):
        """times: a metrics.StreamTimes the wake-ups' latency is added to (stage "wakeup")."""
        self.interval_s = interval_s        # how long outputs may be held for a wake-up that carries more of them
        self.times = times
        self._sent_at: float | None = None  # when the outstanding wake-up was written (perf_counter)
        self.items: deque = deque()         # (job, sequence index, SeqOutput); deque appends are thread-safe
        self.loop: asyncio.AbstractEventLoop | None = None      # the server's event loop (bound by the first Job)
        self.pending = False                # a wake-up is sent and its delivery has not run: it takes what comes
        self._rfd: int | None = None        # the pipe the loop watches
        self._wfd: int | None = None
        self._held_since: float | None = None   # scheduler thread: when the oldest output not yet sent was flushed
        self._urgent = False                # scheduler thread: an output put since the last wake-up is urgent

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:     # event loop thread (every Job)
        if loop is self.loop:
            return
        if self._rfd is None:
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)   # a full pipe means a wake-up is waiting anyway
        elif self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self._rfd)
        loop.add_reader(self._rfd, self._deliver)
        self.loop = loop
        self._deliver()                     # what came while no loop watched

    def put(self, job, i: int, out, urgent: bool = False) -> None:     # scheduler thread, per sequence
        self.items.append((job, i, out))
        if urgent:
            self._urgent = True

    def flush(self, now: bool = False) -> None:
        """Wake the loop for what was put, unless it may be held (see the module docstring); `now`: no holding.
        Scheduler thread, once per step (BatchScheduler.on_step_outputs)."""
        wfd = self._wfd
        if not self.items or wfd is None or self.pending:
            return                          # nothing to send, no loop yet, or the wake-up sent takes it along
        if self.interval_s > 0 and not (now or self._urgent):
            t = time.perf_counter()
            if self._held_since is None:
                self._held_since = t
            if t - self._held_since < self.interval_s:
                return
        self._held_since, self._urgent = None, False
        self._sent_at = time.perf_counter()     # before pending: _deliver reads it before it clears pending
        self.pending = True                 # at most one wake-up outstanding: pending stays set until _deliver
        _write(wfd, b"\0")

    def _deliver(self) -> None:             # event loop
        try:
            os.read(self._rfd, 256)         # first: a wake-up sent after this read is a delivery of its own
        except BlockingIOError:
            pass
        sent, self._sent_at = self._sent_at, None
        if sent is not None and self.times is not None:
            self.times.add("wakeup", time.perf_counter() - sent)
        self.pending = False                # from here on, a new output needs a new wake-up
        items = self.items
        while items:
            job, i, out = items.popleft()
            job.queue.put_nowait((i, out))

    def close(self) -> None:                # event loop thread, once the scheduler has stopped
        if self._rfd is None:
            return
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self._rfd)
        rfd, wfd = self._rfd, self._wfd
        self._rfd = self._wfd = None
        self.loop = None
        os.close(rfd)
        os.close(wfd)

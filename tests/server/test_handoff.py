"""The server's way back from the engine: one handoff to the event loop per step whatever the number of rows
(handoff.py), and stream chunks serialized from a prefix built once, byte for byte what json.dumps writes."""
from __future__ import annotations

import json
import threading
import time

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.engine.scheduler import BatchScheduler, SeqRequest
from leaplm.server.handoff import Mailbox
from leaplm.server.streaming import ChunkEvents, sse


class RecordingLoop:
    """Stands in for the event loop: keeps what call_soon_threadsafe was given."""

    def __init__(self):
        self.calls = []
        self.called = threading.Condition()

    def call_soon_threadsafe(self, fn, *args):     # the mailbox's waker thread
        with self.called:
            self.calls.append((fn, args))
            self.called.notify_all()

    def wait_calls(self, n: int, timeout: float = 10.0) -> int:
        with self.called:
            self.called.wait_for(lambda: len(self.calls) >= n, timeout)
            return len(self.calls)


class Sink:
    def __init__(self):
        self.got = []

    def put_nowait(self, item):
        self.got.append(item)


class FakeJob:
    def __init__(self):
        self.queue = Sink()


def test_one_handoff_per_step_for_every_row(loaded):
    eng = Engine(loaded("llama_tied"), method="none")
    sched = BatchScheduler(eng, max_batch=4, calibrate=False)
    mailbox, loop = Mailbox(), RecordingLoop()
    mailbox.loop = loop
    sched.on_step_outputs = mailbox.flush
    jobs = [FakeJob() for _ in range(4)]
    sched.submit([SeqRequest([3, 1, 4, 1 + i], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True),
                             lambda out, j=j: mailbox.put(j, 0, out)) for i, j in enumerate(jobs)])
    steps = 0
    while sched.step():
        steps += 1
        assert loop.wait_calls(steps) == steps     # four rows' outputs, one call (sent by the waker thread)
        fn, args = loop.calls[-1]
        fn(*args)                                  # the event loop's turn: every row's output reaches its job
        assert all(len(j.queue.got) == steps for j in jobs)
    assert steps == 6 and all(j.queue.got[-1][1].finished for j in jobs)
    sched.step()                                   # nothing ran, nothing came back: no wake-up
    time.sleep(0.2)
    assert len(loop.calls) == steps


def test_no_second_wake_up_while_one_is_pending():
    """Outputs of steps that end before the event loop's turn ride on the wake-up already sent."""
    mailbox, loop, job = Mailbox(), RecordingLoop(), FakeJob()
    mailbox.loop = loop
    for step in range(3):
        mailbox.put(job, 0, step)
        mailbox.flush()
    assert loop.wait_calls(1) == 1
    time.sleep(0.2)
    assert len(loop.calls) == 1
    fn, args = loop.calls[0]
    fn(*args)
    assert job.queue.got == [(0, 0), (0, 1), (0, 2)]
    mailbox.put(job, 0, 3)                         # after the delivery ran, the next output wakes the loop again
    mailbox.flush()
    assert loop.wait_calls(2) == 2


def test_chunk_events_are_the_json_of_the_whole_chunk():
    ev = ChunkEvents("cmpl-1", "text_completion", 17, 'm"odel')
    for choice, usage in [({"index": 0, "text": "déjà \"vu\"\n🙂", "logprobs": None, "finish_reason": None}, None),
                          ({"index": 2, "text": "", "logprobs": None, "finish_reason": "stop", "token_ids": [1, 2]},
                           {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})]:
        whole = {"id": "cmpl-1", "object": "text_completion", "created": 17, "model": 'm"odel',
                 "choices": [choice], "usage": usage}
        assert ev(choice, usage) == sse(whole)
        assert json.loads(ev(choice, usage)[6:]) == whole

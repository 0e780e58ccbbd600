"""The server's way back from the engine: one handoff to the event loop per step whatever the number of rows
(handoff.py), and stream chunks serialized from a prefix built once, byte for byte what json.dumps writes."""
from __future__ import annotations

import asyncio
import json
import threading
import time

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.engine.scheduler import BatchScheduler, SeqRequest
from leaplm.server.handoff import Mailbox
from leaplm.server.streaming import ChunkEvents, sse


class LoopThread:
    """An event loop running in a thread of its own, as the server's does; counts the mailbox's deliveries."""

    def __init__(self, mailbox: Mailbox):
        self.loop = asyncio.new_event_loop()
        self.deliveries = 0
        self.cond = threading.Condition()
        deliver = mailbox._deliver

        def counted():
            deliver()
            with self.cond:
                self.deliveries += 1
                self.cond.notify_all()

        mailbox._deliver = counted                 # what the loop runs on each wake-up
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        bound = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (mailbox.bind(self.loop), bound.set()))
        assert bound.wait(10)
        with self.cond:                            # binding delivers what came before it: not a wake-up
            self.deliveries = 0

    def wait_deliveries(self, n: int, timeout: float = 10.0) -> int:
        with self.cond:
            self.cond.wait_for(lambda: self.deliveries >= n, timeout)
            return self.deliveries

    def stop(self, mailbox: Mailbox) -> None:
        done = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (mailbox.close(), done.set()))
        assert done.wait(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


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
    mailbox = Mailbox()
    loop = LoopThread(mailbox)
    sched.on_step_outputs = mailbox.flush
    jobs = [FakeJob() for _ in range(4)]
    sched.submit([SeqRequest([3, 1, 4, 1 + i], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True),
                             lambda out, j=j: mailbox.put(j, 0, out)) for i, j in enumerate(jobs)])
    steps = 0
    try:
        while sched.step():
            steps += 1
            assert loop.wait_deliveries(steps) == steps     # four rows' outputs, one wake-up of the loop
            assert all(len(j.queue.got) == steps for j in jobs)
        assert steps == 6 and all(j.queue.got[-1][1].finished for j in jobs)
        sched.step()                                   # nothing ran, nothing came back: no wake-up
        time.sleep(0.2)
        assert loop.deliveries == steps
    finally:
        loop.stop(mailbox)


def test_no_second_wake_up_while_one_is_pending():
    """Outputs of steps that end before the event loop's turn ride on the wake-up already sent."""
    mailbox, job = Mailbox(), FakeJob()
    loop = LoopThread(mailbox)
    held = threading.Event()
    loop.loop.call_soon_threadsafe(held.wait)      # the loop is busy: the wake-up waits for its turn
    try:
        for step in range(3):
            mailbox.put(job, 0, step)
            mailbox.flush()
        held.set()
        assert loop.wait_deliveries(1) == 1
        time.sleep(0.2)
        assert loop.deliveries == 1
        assert job.queue.got == [(0, 0), (0, 1), (0, 2)]
        mailbox.put(job, 0, 3)                     # after the delivery ran, the next output wakes the loop again
        mailbox.flush()
        assert loop.wait_deliveries(2) == 2 and job.queue.got[-1] == (0, 3)
    finally:
        held.set()
        loop.stop(mailbox)


def test_chunk_events_are_the_json_of_the_whole_chunk():
    ev = ChunkEvents("cmpl-1", "text_completion", 17, 'm"odel')
    for choice, usage in [({"index": 0, "text": "déjà \"vu\"\n🙂", "logprobs": None, "finish_reason": None}, None),
                          ({"index": 2, "text": "", "logprobs": None, "finish_reason": "stop", "token_ids": [1, 2]},
                           {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})]:
        whole = {"id": "cmpl-1", "object": "text_completion", "created": 17, "model": 'm"odel',
                 "choices": [choice], "usage": usage}
        assert ev(choice, usage) == sse(whole)
        assert json.loads(ev(choice, usage)[6:]) == whole


def test_outputs_are_held_for_the_interval_unless_urgent():
    """With an interval, a step's outputs wait for later ones (one wake-up for several steps), except an urgent
    one (a first token, an end), or a flush told not to hold (requests are waiting to join)."""
    mailbox, job = Mailbox(interval_s=0.3), FakeJob()
    loop = LoopThread(mailbox)
    try:
        mailbox.put(job, 0, "a")
        mailbox.flush()                            # the first held output: its interval starts now
        mailbox.put(job, 0, "b")
        mailbox.flush()
        time.sleep(0.1)
        assert loop.deliveries == 0 and job.queue.got == []
        time.sleep(0.25)
        mailbox.put(job, 0, "c")
        mailbox.flush()                            # the interval has passed: everything held goes in one wake-up
        assert loop.wait_deliveries(1) == 1 and job.queue.got == [(0, "a"), (0, "b"), (0, "c")]

        mailbox.put(job, 0, "d")
        mailbox.flush()
        mailbox.put(job, 0, "e", urgent=True)      # an urgent output takes the held one along at once
        mailbox.flush()
        assert loop.wait_deliveries(2) == 2 and job.queue.got[3:] == [(0, "d"), (0, "e")]

        mailbox.put(job, 0, "f")
        mailbox.flush(now=True)
        assert loop.wait_deliveries(3) == 3 and job.queue.got[5:] == [(0, "f")]
        time.sleep(0.1)
        assert loop.deliveries == 3
    finally:
        loop.stop(mailbox)

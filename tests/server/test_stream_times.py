"""Where a streamed token's time goes (metrics.StreamTimes): every wake-up of the loop, every serialization of a
stream's chunks and every write is counted by stage on /metrics; binding the mailbox is not a wake-up. Counts, not
timings, are asserted."""
from __future__ import annotations

import httpx

from leaplm.server.handoff import Mailbox
from leaplm.server.metrics import StreamTimes

from serverkit import MODEL
from test_handoff import LoopThread, Sink


class FakeJob:
    def __init__(self):
        self.queue = Sink()


def test_each_wake_up_is_timed_once_and_binding_is_not_a_wake_up():
    times = StreamTimes()
    mailbox = Mailbox(times=times)
    loop = LoopThread(mailbox)
    try:
        assert times.events["wakeup"] == 0
        job = FakeJob()
        for step in range(3):
            mailbox.put(job, 0, f"out{step}")
            mailbox.flush()
            loop.wait_deliveries(step + 1)
        assert times.events["wakeup"] == 3 and times.seconds["wakeup"] > 0
        assert job.queue.got == [(0, "out0"), (0, "out1"), (0, "out2")]
    finally:
        loop.stop(mailbox)


def test_a_stream_counts_its_wake_ups_serializations_and_writes(server):
    def counts():
        return {(kind, stage): server.metric(f"leaplm_stream_{kind}_total", f'stage="{stage}"')
                for kind in ("events", "seconds") for stage in StreamTimes.STAGES}

    before = counts()
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=60,
                      json={"model": MODEL, "prompt": "the quick", "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        body = b"".join(r.iter_bytes())
    assert body.endswith(b"data: [DONE]\n\n")
    after = counts()
    for stage in StreamTimes.STAGES:
        assert after["events", stage] > before["events", stage], stage
        assert after["seconds", stage] > before["seconds", stage], stage
    # every serialization is written; the stream's [DONE] (and nothing else) is a write of its own
    assert after["events", "write"] - before["events", "write"] >= after["events", "serialize"] - \
        before["events", "serialize"]
    s = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                   json={"model": MODEL, "prompt": "the quick", "max_tokens": 4, "temperature": 0})
    assert s.status_code == 200
    assert counts()["events", "write"] == after["events", "write"]        # a JSON answer is no stream write

"""Prometheus metrics of one server (a CollectorRegistry per app, so several apps in one process never mix).

Names follow vLLM's where one exists (spec_decode_num_drafts, ..._num_accepted_tokens_per_pos), so figures can be
compared across engines. The scheduler reports each step as a StepReport (observer.on_step, called from its
thread; prometheus_client is thread-safe); request-level figures are recorded by the HTTP handlers.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily

from ..engine.scheduler import StepReport

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
P = "leaplm_"


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(P + "requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.refusals_repeated = Counter(P + "refusals_repeated", "Requests answered with the 400 their body got "
                                         "before, without parsing it again (counted in requests too).",
                                         registry=r)
        self.bodies_off_loop = Counter(P + "request_bodies_decoded_off_loop", "Request bodies large enough to be "
                                       "decoded in a worker thread instead of on the event loop.", registry=r)
        self.grammar_cache = Counter(P + "grammar_cache", "Requests with structured-output fields, by whether what "
                                     "the fields come to (a grammar or a 400) was kept from an earlier request "
                                     "(result=hit) or built for this one (result=miss).", ["result"], registry=r)
        self.grammar_build = Histogram(P + "grammar_build_seconds", "Time a request's structured-output fields took "
                                       "to become a grammar (or a 400) in the grammar pool, by cache result.",
                                       ["cache"], buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter(P + "request_finish", "Generated sequences by finish reason "
                                "(stop, length, abort, error).", ["reason"], registry=r)
        self.queue_depth = Gauge(P + "queue_depth", "Requests waiting for a batch row.", registry=r)
        self.running = Gauge(P + "running_requests", "Requests in the running batch.", registry=r)
        self.rows_in_use = Gauge(P + "kv_cache_rows_in_use", "Target KV-cache rows holding tokens.", registry=r)
        self.cached_tokens = Gauge(P + "kv_cache_tokens", "Tokens held in the target KV cache.", registry=r)
        self.cache_bytes = Gauge(P + "kv_cache_bytes", "Bytes the target KV cache holds (allocated now: it grows "
                                 "with the running sequences and shrinks when none runs).", registry=r)
        self.cache_peak_bytes = Gauge(P + "kv_cache_peak_bytes", "Most bytes the target KV cache has held.",
                                      registry=r)
        self.reserved_tokens = Gauge(P + "kv_cache_reserved_tokens", "KV-cache tokens reserved by admitted "
                                     "sequences (prompt + max_tokens each) until they finish.", registry=r)
        self.budget_tokens = Gauge(P + "kv_cache_budget_tokens", "KV-cache tokens admission may reserve "
                                   "(--kv-cache-bytes).", registry=r)
        self.in_flight = Gauge(P + "sequences_in_flight", "Sequences waiting or running.", registry=r)
        self.native_cells = Gauge(P + "native_kv_cells", "KV cells held, as the backend counts them (llama.cpp: "
                                  "each sequence's positions asked of its contexts; torch: the cache's committed "
                                  "slots), by cache (target, or the draft model's).", ["cache"], registry=r)
        self.native_seqs = Gauge(P + "native_sequences", "Sequences (rows, tree scratch sequences) holding KV cells, "
                                 "as the backend counts them, by cache.", ["cache"], registry=r)
        self.llamacpp_contexts = Gauge(P + "llamacpp_contexts", "llama.cpp contexts alive in the process (every "
                                       "model's: created and not freed).", registry=r)
        self.native_heap = Gauge(P + "native_heap_bytes", "Bytes the C allocator has handed out and not had back "
                                 "(glibc mallinfo2: arena + mmapped chunks): libllama's, the C++ kernel's and "
                                 "torch's CPU tensors' memory. 0 where it cannot be read.", registry=r)
        ProcessCollector(registry=r)      # process_resident_memory_bytes and friends: what the server holds
        self.stream_times = StreamTimes()
        r.register(StreamTimesCollector(self.stream_times))
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between generated tokens (a step's time shared "
                             "evenly by the tokens it emitted).", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of admitted sequences.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", registry=r)
        self.steps = Counter(P + "engine_steps", "Batched engine steps.", registry=r)
        self.step_seconds = Histogram(P + "engine_step_seconds", "Duration of one batched step.",
                                      buckets=_ITL_BUCKETS, registry=r)
        self.batch_size = Histogram(P + "engine_step_batch_size", "Rows per batched step.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.drafts = Counter(P + "spec_decode_num_drafts", "Row-steps that drafted at least one token.", registry=r)
        self.draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Drafted tokens.", registry=r)
        self.accepted_tokens = Counter(P + "spec_decode_num_accepted_tokens", "Accepted draft tokens.", registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft (0 = first).",
                                        ["position"], registry=r)
        self.accepted_prediction = Counter(P + "accepted_prediction_tokens", "Predicted Outputs: prediction tokens "
                                           "drafted and kept in the output.", registry=r)
        self.rejected_prediction = Counter(P + "rejected_prediction_tokens", "Predicted Outputs: prediction tokens "
                                           "drafted and not kept.", registry=r)
        self.k = Gauge(P + "spec_decode_k", "K of the last step (0: speculation off because it would not pay "
                       "at this batch size, or no request speculates).", registry=r)
        self.k_by_batch = Gauge(P + "spec_decode_k_by_batch_size", "K of the last step at each batch size.",
                                ["batch_size"], registry=r)

        self.backend = Gauge(P + "backend_info", "1 for what runs the target's forwards (torch or llamacpp) and "
                             "what greedy speculation promises on it (identical, or identical up to llama.cpp's "
                             "batch variance).", ["backend", "exactness"], registry=r)
        self.backend_choice = Gauge(P + "backend_choice_info", "1 for why the target runs on its backend (the "
                                    "`--backend auto` rule, or the explicit choice).", ["backend", "reason"],
                                    registry=r)
        self.spec_memory = Gauge(P + "speculative_memory_bytes", "Memory speculation adds to the target alone, by "
                                 "part: draft_weights, and draft_kv_cache_per_row (each running request that drafts "
                                 "with the draft model holds one).", ["part"], registry=r)

    def bind(self, scheduler, admission=None) -> None:
        """Gauges read from the scheduler (and the admission bookkeeping) at scrape time."""
        from .admission import cache_bytes

        self.cache_bytes.set_function(lambda: cache_bytes(scheduler.cache) or 0)
        self.cache_peak_bytes.set_function(lambda: getattr(scheduler.cache, "peak_nbytes", 0) or 0)
        self.in_flight.set_function(lambda: scheduler.sequences_in_flight)
        if admission is not None:
            self.reserved_tokens.set_function(lambda: admission.reserved_tokens)
            self.budget_tokens.set_function(lambda: admission.budget_tokens or 0)
        eng = scheduler.engine
        self.backend.labels(getattr(eng, "backend", "torch"), getattr(eng, "exactness", "identical")).set(1)
        self.backend_choice.labels(getattr(eng, "backend", "torch"), getattr(eng, "backend_reason", "")).set(1)
        draft = getattr(scheduler.engine, "draft", None)
        if draft is not None:
            from ..models.footprint import draft_footprint

            weights, per_row = draft_footprint(draft, scheduler.max_len)
            self.spec_memory.labels("draft_weights").set(weights)
            self.spec_memory.labels("draft_kv_cache_per_row").set(per_row)
        for name in ("target", "draft"):
            self.native_cells.labels(name).set_function(lambda name=name: scheduler.held[name][0])
            self.native_seqs.labels(name).set_function(lambda name=name: scheduler.held[name][1])
        self.llamacpp_contexts.set_function(llamacpp_contexts)
        self.native_heap.set_function(native_heap_bytes)
        self.queue_depth.set_function(lambda: scheduler.queue_depth)
        self.running.set_function(lambda: scheduler.running)
        self.rows_in_use.set_function(lambda: scheduler.rows_in_use)
        self.cached_tokens.set_function(lambda: scheduler.cached_tokens)

    # observer protocol of BatchScheduler
    def on_step(self, s: StepReport) -> None:
        self.steps.inc()
        self.step_seconds.observe(s.step_s)
        self.batch_size.observe(s.batch_size)
        self.k.set(s.k)
        self.k_by_batch.labels(str(s.batch_size)).set(s.k)
        for d, a in zip(s.drafted, s.accepted):
            if d:
                self.drafts.inc()
                self.draft_tokens.inc(d)
                self.accepted_tokens.inc(a)
                for pos in range(a):
                    self.accepted_per_pos.labels(str(pos)).inc()
        self.generation_tokens.inc(sum(s.emitted))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StreamTimes:
    """Where a streamed token's time goes between its step and the client's socket, summed in plain floats (every
    stage runs on the event loop's thread; a Histogram's lock and buckets would cost more than what is timed):

      wakeup     the step's end (the wake-up written to the mailbox's pipe, scheduler thread) to the loop's turn
                 that delivers its outputs (handoff.py)
      serialize  a stream's outputs of one wake-up into its SSE chunks: bookkeeping and JSON (responses.py)
      write      one write of those chunks to the ASGI send, uvicorn's write to the socket included

    With leaplm_engine_step_seconds and leaplm_generation_tokens_total, each over the tokens generated gives a
    streamed token's share of each stage (`leaplm bench serve` reports them as server_path_ms_per_token)."""

    STAGES = ("wakeup", "serialize", "write")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.events = dict.fromkeys(self.STAGES, 0)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] += seconds
        self.events[stage] += 1


class StreamTimesCollector:
    """StreamTimes as two Prometheus counters by stage: leaplm_stream_seconds_total, leaplm_stream_events_total."""

    def __init__(self, times: StreamTimes):
        self.times = times

    def collect(self):
        seconds = CounterMetricFamily(P + "stream_seconds", "Seconds spent per stage of the way from a step to a "
                                      "stream's socket (wakeup, serialize, write; see server/metrics.py "
                                      "StreamTimes).", labels=["stage"])
        events = CounterMetricFamily(P + "stream_events", "Wake-ups, serializations and writes timed in "
                                     "leaplm_stream_seconds_total, by stage.", labels=["stage"])
        for stage in StreamTimes.STAGES:
            seconds.add_metric([stage], self.times.seconds[stage])
            events.add_metric([stage], self.times.events[stage])
        yield seconds
        yield events


def llamacpp_contexts() -> int:
    import sys

    mod = sys.modules.get("leaplm.models.llamacpp.caches")     # never loaded: no context
    return mod.live_contexts() if mod is not None else 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = None


def native_heap_bytes() -> int:
    """glibc's mallinfo2(): bytes in use in its arenas (uordblks) plus mmapped chunks (hblkhd); 0 without it."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.mallinfo2.restype = _MallInfo2
            _libc = lib
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return 0
    m = _libc.mallinfo2()
    return int(m.uordblks + m.hblkhd)

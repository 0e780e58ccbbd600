"""The server's state: the engine, its scheduler and admission once loaded, readiness and draining; and the
scheduler built, calibrated and warmed up for serving."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..config import SamplingParams, ServerConfig
from ..engine.scheduler import BatchScheduler, SeqRequest
from .admission import Admission
from .handoff import Mailbox
from .metrics import ServerMetrics
from .streaming import TokenText

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the routes share: set up by create_app, the engine and scheduler attached once loaded."""
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    engine: object | None = None
    scheduler: BatchScheduler | None = None
    admission: Admission | None = None
    token_text: TokenText | None = None
    mailbox: Mailbox = field(init=False)    # the scheduler thread's outputs, at most once per step (handoff.py)
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    load_error_is_input: bool = False   # the load failed on bad input (ConfigError): serve exits 2
    created: int = field(default_factory=lambda: int(time.time()))
    max_token_chars: int = 0        # the longest token's text: a prompt longer than this x context never fits
    # Tokenizing (and templating) runs here, off the event loop; one worker, since a fast tokenizer object is not
    # safe to use from several threads at once.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="leaplm-tokenize"))
    # Large request bodies are decoded here, off the event loop (body.py)
    body_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="leaplm-body"))
    # Grammars compile here (llguidance drops the GIL; a hostile one takes up to seconds of CPU), beside the
    # tokenizing, at the lowest CPU priority: a compile gets the cores the steps and the event loop leave
    grammar_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="leaplm-grammar",
                                                   initializer=lowest_cpu_priority))
    # structured-output fields' text (digest) -> what they came to: a StructuredOutput or the 400 (planning.py);
    # the last 16 distinct ones, least recently used out first
    structured_seen: "Recent" = field(default_factory=lambda: Recent(16))
    # bodies refused with a 400 before they ran (digest of route, Content-Type and bytes) -> that 400's ASGI
    # messages, answered again without parsing the body (middleware.py)
    refused: "Recent" = field(default_factory=lambda: Recent(64))

    def __post_init__(self) -> None:
        self.mailbox = Mailbox(self.config.stream_interval_ms / 1000, self.metrics.stream_times)

    def attach(self, engine, scheduler: BatchScheduler) -> None:
        self.engine, self.scheduler = engine, scheduler
        self.token_text = TokenText(engine.tokenizer)
        self.max_token_chars = longest_token_chars(engine.tokenizer)
        self.admission = Admission.for_scheduler(scheduler, self.config.max_batch, self.config.max_queue,
                                                 self.config.kv_cache_bytes)
        self.metrics.bind(scheduler, self.admission)
        scheduler.observer = self.metrics
        mailbox = self.mailbox
        # held outputs go out before a request joins: the next step may prefill a long prompt
        scheduler.on_step_outputs = lambda: mailbox.flush(now=scheduler.admits_next)


class Recent:
    """The last `size` values put, by key (least recently used out first); safe across threads."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def lowest_cpu_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19) where a thread has its own (Linux), so that it runs
    on what the other threads leave: a hostile grammar's seconds of compiling then take no CPU from the steps of
    the requests running meanwhile (docs/reliability.md: the hostile-grammar attack). Elsewhere a thread's
    priority is the process's own, left as it is."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError as e:          # a sandbox that forbids it: the pool runs at the process's priority
            log.warning("could not lower the grammar compiles' CPU priority: %s", e)


def build_scheduler(engine, config: ServerConfig) -> BatchScheduler:
    """The scheduler over engine, warmed up (one short request through every stage) and calibrated from the
    start-up cache, or calibrating between requests once it serves (BatchScheduler.calibrate_when_idle)."""
    rows = config.max_batch
    if rows > 1 and not engine.model.capabilities.batch:   # the transformers fallback
        log.warning("%s runs one sequence per forward: serving with one batch row (requests beyond it queue)",
                    type(engine.model).__name__)
        rows = 1
    # the cost calibration from the start-up cache, else measured by the scheduler between requests once serving
    sched = BatchScheduler(engine, max_batch=rows, max_queue=max(config.max_queue, 1), calibrate="idle")
    ids = engine.tokenizer("warm up", add_special_tokens=False)["input_ids"] or [0]
    sched.submit([SeqRequest(ids[: max(1, engine.max_model_len // 2)], SamplingParams(max_new_tokens=4, temperature=0),
                             on_output=lambda out: None)])
    sched.run_until_idle()
    sched.max_queue = config.max_batch + config.max_queue     # a backstop: admission.py counts in flight first
    return sched


def longest_token_chars(tok) -> int:
    """Characters of the vocabulary's longest token string (byte-level and sentencepiece token strings are at
    least as long as the text they stand for), so len(text) > this x n means more than n tokens. Read from the
    vocabulary (token -> id, every token once), which a cached tokenizer answers without transformers."""
    return max(1, max((len(t) for t in tok.get_vocab() if t), default=1))


def max_prompt_chars(state: ServerState) -> int:
    """Characters beyond which a prompt cannot fit the context, whatever it says (checked before tokenizing)."""
    return state.max_token_chars * state.engine.max_model_len

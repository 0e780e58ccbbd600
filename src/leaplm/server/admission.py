"""Admission at the server's door: how many sequences and how much KV-cache memory may be in flight.

Counted in sequences (a request with P prompts and n choices is P x n sequences, n up to 128), running ones
included: a request whose sequences could never be in flight at once (more than max_batch + max_queue) is refused
with 400 naming n (or the prompt), before its sequences are planned; one that would bring the sequences waiting or
running over that now gets 429. Counted in cache memory (with --kv-cache-bytes): every admitted sequence, waiting
or running, reserves prompt + max_tokens tokens of KV cache (what it can grow to) from the budget until it
finishes; a request whose sequences could never fit the budget is refused with 400 naming max_tokens (one
sequence too long), or the prompt, or n (prompts x n sequences too many); one that fits the budget but not what is
unreserved now gets 429. Without a budget the cache has max_batch rows whatever n is (choices beyond them wait for
a row, holding only their prompt's ids) and grows with the running sequences up to max_batch x max_model_len, and a
sequence that passes the context check fits its row. Both 429s carry a Retry-After derived from the measured drain
rate (sequences and reserved tokens finished per second over the last finishes), not a constant, and name n when
the request has several sequences. Every refusal comes before any of the request's sequences is queued.

Counted in memory (always): a cache that grows with its rows (the torch KVCache) is never asked to grow past the
memory the system has available (MemAvailable): a request whose longest sequence would make it grow beyond 90% of
that is refused with 503 (code insufficient_memory) naming max_tokens, before the kernel's out-of-memory killer
would end the whole server.

cache_bytes() is the one place that knows how to read a cache's size (the growing KVCache tells its nbytes;
bytes_per_token divides by the capacity it has now).
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..config import ConfigError
from ..devices import available_memory
from .protocol import APIError

RETRY_MIN_S, RETRY_MAX_S = 1, 60


def cache_bytes(cache) -> int | None:
    """Bytes a KV cache holds now (None when it cannot be told, e.g. a transformers DynamicCache)."""
    n = getattr(cache, "nbytes", None)
    if isinstance(n, int):
        return n
    k, v = getattr(cache, "k", None), getattr(cache, "v", None)
    if isinstance(k, list) and isinstance(v, list):
        return sum(t.numel() * t.element_size() for t in k + v)
    return None


def bytes_per_token(cache) -> float | None:
    """Bytes of cache one token of one row takes (every layer's K and V), or None when unknown."""
    total = cache_bytes(cache)
    rows, length = getattr(cache, "batch_size", 1), getattr(cache, "max_len", None)
    if total is None or not length:
        return None
    capacity = getattr(cache, "capacity_tokens", None) or rows * length   # a growing cache: what it has now
    return total / capacity if capacity else None


@dataclass
class DrainRate:
    """Sequences and reserved tokens finished per second, over the last `window` finishes."""
    window: int = 32
    _done: deque = field(default_factory=deque)       # (time, tokens) per finished sequence

    def record(self, tokens: int, now: float | None = None) -> None:
        self._done.append((time.monotonic() if now is None else now, tokens))
        while len(self._done) > self.window:
            self._done.popleft()

    def rates(self) -> tuple[float, float] | None:
        """(sequences/s, tokens/s), or None before two finishes."""
        if len(self._done) < 2:
            return None
        span = max(self._done[-1][0] - self._done[0][0], 1e-3)
        n = len(self._done) - 1                              # finishes after the first one, over the span
        tokens = sum(t for _, t in list(self._done)[1:])
        return n / span, tokens / span

    def retry_after(self, sequences: int = 0, tokens: int = 0) -> int:
        """Whole seconds until `sequences` more sequences and `tokens` more reserved tokens have drained."""
        r = self.rates()
        if r is None:
            return RETRY_MIN_S
        seq_rate, tok_rate = r
        wait = max(sequences / seq_rate if seq_rate > 0 else 0.0, tokens / tok_rate if tok_rate > 0 else 0.0)
        return int(min(RETRY_MAX_S, max(RETRY_MIN_S, math.ceil(wait))))


class Admission:
    """The door's bookkeeping (event-loop thread; release() may come from any thread)."""

    MEMORY_SHARE = 0.9          # of MemAvailable a growing cache may take

    def __init__(self, max_batch: int, max_queue: int, budget_tokens: int | None, budget_bytes: int | None,
                 cache=None):
        """cache: the target's KV cache, when it grows with its rows (checked against available memory)."""
        self.cache = cache
        self.max_batch = max_batch
        self.max_sequences = max_batch + max_queue
        self.budget_tokens = budget_tokens
        self.budget_bytes = budget_bytes
        self.reserved_tokens = 0
        self.drain = DrainRate()
        self._lock = threading.Lock()

    @classmethod
    def for_scheduler(cls, scheduler, max_batch: int, max_queue: int, kv_cache_bytes: int | None) -> "Admission":
        per_token = bytes_per_token(scheduler.cache)
        if kv_cache_bytes is None:
            budget = None
        elif per_token is None:
            raise ConfigError("kv_cache_bytes", "this model's cache cannot tell its size in bytes; leave "
                                                "--kv-cache-bytes unset")
        else:
            budget = int(kv_cache_bytes // per_token)
        cache = scheduler.cache
        grows = per_token is not None and getattr(cache, "capacity_tokens", None) is not None and \
            cache.capacity_tokens < cache.batch_size * cache.max_len
        return cls(max_batch, max_queue, budget, kv_cache_bytes, cache if grows else None)

    def check(self, in_flight: int, reservations: list[int], prompt_lens: list[int], max_tokens: int,
              max_field: str, prompt_field: str, n: int = 1) -> None:
        """Raise the APIError (400 never fits, 429 not now) that admitting these sequences deserves, if any.
        reservations: each sequence's prompt + max_tokens; n: choices per prompt (the field named when the
        request's size, not one sequence, is what does not fit)."""
        B = self.budget_tokens
        longest = max(reservations)
        size_field = "n" if n > 1 else prompt_field
        if B is not None and longest > B:
            plen = max(prompt_lens)
            if plen >= B:
                raise APIError(400, f"{prompt_field}: the prompt ({plen} tokens) alone exceeds the KV-cache budget "
                                    f"of {B} tokens (--kv-cache-bytes)", prompt_field, "cache_budget_exceeded")
            raise APIError(400, f"{max_field}: the prompt ({plen} tokens) + {max_field} ({max_tokens}) = "
                                f"{plen + max_tokens} tokens exceed the KV-cache budget of {B} tokens "
                                f"(--kv-cache-bytes); lower {max_field}", max_field, "cache_budget_exceeded")
        total = sum(reservations)
        if B is not None and total > B:
            raise APIError(400, f"{size_field}: the request's {len(reservations)} sequences (prompts x n = "
                                f"{len(prompt_lens)} x {n}) reserve {total} tokens of KV cache (prompt + {max_field} "
                                f"each), more than the budget of {B} tokens (--kv-cache-bytes); lower {size_field} "
                                f"or {max_field}", size_field, "cache_budget_exceeded")
        self.check_count(len(reservations), n, prompt_field)
        over = in_flight + len(reservations) - self.max_sequences
        if over > 0:
            wait = self.drain.retry_after(sequences=over)
            raise APIError(429, f"server busy: {in_flight} sequences are waiting or running and this request adds "
                                f"{len(reservations)} (max_batch + max_queue = {self.max_sequences}); retry later",
                           size_field if len(reservations) > 1 else None, "queue_full", {"Retry-After": str(wait)})
        self._check_memory(longest, max_field)
        if B is None:
            return
        with self._lock:
            short = self.reserved_tokens + total - B
        if short > 0:
            wait = self.drain.retry_after(tokens=short)
            raise APIError(429, f"server busy: {self.reserved_tokens} of {B} KV-cache tokens are reserved and this "
                                f"request needs {total}; retry later", size_field if len(reservations) > 1 else None,
                           "cache_full", {"Retry-After": str(wait)})

    def check_count(self, sequences: int, n: int, prompt_field: str) -> None:
        """400 when a request's sequences (prompts x n) could never be in flight at once on this server, whatever
        else runs: checked before the sequences are planned, and again at admission."""
        if sequences <= self.max_sequences:
            return
        size_field = "n" if n > 1 else prompt_field
        raise APIError(400, f"{size_field}: {sequences} sequences (prompts x n) exceed what the server holds "
                            f"(max_batch + max_queue = {self.max_sequences}); lower {size_field}, or serve with "
                            f"--max-queue {sequences - self.max_batch} or more", size_field, "invalid_value")

    def _check_memory(self, longest: int, max_field: str) -> None:
        """503 when a sequence of `longest` tokens would grow the cache past MEMORY_SHARE of available memory."""
        c = self.cache
        if c is None or longest <= c.capacity:
            return
        # the cache grows every row at once, to at least twice its capacity (cache/kv_cache.py), and holds the old
        # storage while it copies: the new storage must fit in what is available
        per_row_token = cache_bytes(c) / max(1, c.capacity_tokens)
        new_bytes = per_row_token * c.batch_size * min(c.max_len, max(longest, 2 * c.capacity))
        avail = available_memory()
        if avail is not None and new_bytes > self.MEMORY_SHARE * avail:
            raise APIError(503, f"{max_field}: a sequence of {longest} tokens would grow the KV cache to "
                                f"{new_bytes / 2**20:.0f} MiB, more than the {avail / 2**20:.0f} MiB of memory "
                                f"available; lower {max_field} or retry later", max_field, "insufficient_memory",
                           {"Retry-After": str(self.drain.retry_after(sequences=1))})

    def reserve(self, tokens: int) -> None:
        with self._lock:
            self.reserved_tokens += tokens

    def unreserve(self, tokens: int) -> None:
        """Give back a reservation whose sequences never entered the scheduler (no drain recorded)."""
        with self._lock:
            self.reserved_tokens -= tokens

    def release(self, tokens: int) -> None:
        """A sequence finished (or was aborted and its row freed): its reservation drains."""
        with self._lock:
            self.reserved_tokens -= tokens
        self.drain.record(tokens)

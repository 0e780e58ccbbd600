"""Continuous batching: one step loop serves many requests, each a row of one batched target KV cache.

Requests join and leave between steps. A step over the n running rows is the engine's four calls, batched:

  1. propose  each row's own proposer drafts k_i <= K tokens (K chosen per step by BatchAdaptiveK from the
              measured cost of a batched forward at (n, K + 1) and each row's measured acceptance)
  2. score    ONE target forward over [n, 1 + max k_i]: row i is [its last token, its drafts, padding]
  3. verify   per row, the engine's pure verifiers on that row's first 1 + k_i logits
  4. commit   per row, engine/commit.py: tokens, stop ids and strings, max_new_tokens, logprobs, stats, and
              cache.advance(accepted + 1, row)

Padding is harmless: a row commits only its accepted + 1 slots, and causal attention means the logits of its
real positions never see the padding after them. Running requests always occupy rows [0, n): a request that
leaves (finished, aborted, failed) has the last row moved into its place (KVCache.move_row).

K policy: BatchAdaptiveK (engine/adaptive.py) picks the K that maximises the batch's expected token rate from
measured batched-forward costs cost(n, T) and per-row acceptance; as the batch fills and the forward turns
compute-bound, K falls to 0. Exception: a sampling request with a seed always drafts its own K (unless the
context is nearly full), so its random draws and hence its text are reproducible.

Tree proposals (Proposal.parents set: suffix, lookahead) are verified one row at a time: the batched forward
carries such a row's last token alone, then the row gets its own forward with the tree mask over a batch-1 view
of its cache row (engine/tree_step.py), the tree verifier, and the same commit (which compacts the accepted
path). Proposers that draft into the target cache (layer-skip) get the same row view as ProposeContext's cache.

Threading: the loop runs in one background thread (start/stop). submit() and abort() may be called from any
thread; outputs go back through each request's on_output callback, called from the loop thread (the server
hands them to its event loop with call_soon_threadsafe). An abort is honoured at the next step boundary, where
the row is freed.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import ConfigError, SamplingParams
from ..propose.base import Proposal, ProposeContext, Proposer
from ..propose.registry import make_proposer_factory
from ..sampling import LogitsProcessor
from .adaptive import AcceptanceEstimate, BatchAdaptiveK, BatchCostModel, RowSpec, expected_tokens
from .commit import commit, finish_chunk, new_request, verify_chain
from .request import Request, StreamChunk, TokenLogprob
from .tree_step import extra_logits, tree_block, verify_tree

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests are waiting than the scheduler's max_queue allows."""


class SchedulerClosed(RuntimeError):
    """The scheduler is stopping (or stopped) and takes no new requests."""


_ids = itertools.count()


@dataclass
class SeqRequest:
    """One sequence to generate, as a caller hands it to the scheduler."""
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[["SeqOutput"], None]     # called from the scheduler thread
    method: str | None = None                    # proposer method; None = the scheduler's, "none" = no drafts
    k: int | None = None                         # most tokens drafted per step; None = the scheduler's K
    prompt_logprobs: int | None = None           # return prompt-token logprobs with this many alternatives
    request_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    aborted: bool = False                        # set through BatchScheduler.abort, honoured at a step boundary
    abort_reason: str | None = None


@dataclass
class SeqOutput:
    """What one step produced for one request: a chunk, or an error that ended it."""
    request_id: str
    chunk: StreamChunk | None = None             # finish_reason and stats set on the last chunk
    error: str | None = None                     # set when the request ended without finishing
    prompt_logprobs: list[TokenLogprob | None] | None = None   # first output only; position 0 has none
    time: float = field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.chunk is not None and self.chunk.finish_reason is not None)


@dataclass
class StepReport:
    """Figures of one batched step, for metrics (read-only data)."""
    batch_size: int
    k: int                          # the step's K (0: no row drafted)
    block_len: int                  # T = 1 + longest draft
    drafted: list[int]              # per row
    accepted: list[int]             # per row
    emitted: list[int]              # per row
    propose_s: float
    score_s: float
    step_s: float


@dataclass
class _Row:
    """Scheduler-owned state of one running request."""
    seq: SeqRequest
    req: Request
    proc: LogitsProcessor
    proposer: Proposer | None
    cap: int                                         # this request's own K (0: no speculation)
    fixed_k: bool = False                            # draft cap tokens every step (seeded sampling), see below
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)


class BatchScheduler:
    """Continuous batching over one engine's target (and draft): see the module docstring.

    engine: a leaplm Engine (its target, draft, tokenizer, SpecConfig and max_model_len are used; its own
    single-request cache is not). observer: optional object with on_step(StepReport), called per step.
    """

    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64, observer=None, calibrate: bool = True):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError("max_batch", f"must be an integer >= 1, got {max_batch!r}")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ConfigError("max_queue", f"must be an integer >= 0, got {max_queue!r}")
        self.engine = engine
        self.model = engine.model
        if max_batch > 1 and not getattr(self.model, "supports_batch", False):
            raise ConfigError("max_batch", f"{type(self.model).__name__} runs one sequence at a time; "
                                           "use max_batch 1 with this model")
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_len = engine.max_model_len
        self.observer = observer
        self.cache = self.model.new_cache(max_batch, self.max_len)
        self.policy = BatchAdaptiveK(BatchCostModel(), enabled=engine.spec.adaptive_k)
        self.current_k = 0                               # K of the last step (exported as a gauge)
        self.draft_prefill_s_per_token = 0.0             # calibrated: a draft model's prefill cost per token
        self.steps = 0
        self._factories: dict[str, Callable[[int], Proposer] | None] = {"none": None}
        self._factories_lock = threading.Lock()
        self._propose_cost: dict[str, float] = {}        # method -> EMA of proposer seconds per drafted token
        # method -> acceptance over all its requests (slow EMA): the starting estimate of a new request's row
        self._method_acceptance: dict[str, AcceptanceEstimate] = {}
        self._waiting: deque[SeqRequest] = deque()
        self._running: list[_Row] = []                   # row i of the cache <-> _running[i]; loop thread only
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if engine.spec.method != "none":
            self.proposer_factory(engine.spec.method)
        if calibrate:                                    # also without a default method: requests may ask for one
            self.calibrate()

    # --- any thread ----------------------------------------------------------------------------------------
    @property
    def default_method(self) -> str:
        return self.engine.spec.method

    @property
    def default_k(self) -> int:
        return self.engine.spec.k if self.engine.spec.method != "none" else 0

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def sequences_in_flight(self) -> int:
        """Sequences waiting or running (what a queue limit counted in sequences, running ones included, uses)."""
        with self._cond:
            return len(self._waiting) + len(self._running)

    @property
    def rows_in_use(self) -> int:
        """Cache rows holding tokens (running rows; a freed row is reset to length 0)."""
        return sum(1 for n in self.cache.lengths if n > 0)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cache.lengths)

    def proposer_factory(self, method: str) -> Callable[[int], Proposer] | None:
        """The proposer factory for `method` (built once, then shared); ConfigError if it cannot run here."""
        with self._factories_lock:
            if method in self._factories:
                return self._factories[method]
            eng = self.engine
            try:
                spec = dataclasses.replace(eng.spec, method=method,
                                           draft=eng.draft.name if eng.draft is not None else None)
                factory = make_proposer_factory(spec, eng.target, eng.draft)
            except ConfigError as e:
                if e.field in ("method", "draft"):
                    raise ConfigError("method", f"method {method!r} is not available on this server: {e.message}"
                                      ) from None
                raise
            self._factories[method] = factory
            return factory

    def submit(self, seqs: list[SeqRequest]) -> None:
        """Queue sequences (all or none). Raises QueueFull over max_queue, SchedulerClosed when stopping."""
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is shutting down")
            if len(self._waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
            self._waiting.extend(seqs)
            self._cond.notify()

    def abort(self, seq: SeqRequest, reason: str | None = None) -> None:
        """Mark seq aborted; the loop drops it (and frees its row) at the next step boundary."""
        seq.abort_reason = reason or "aborted"
        seq.aborted = True
        with self._cond:
            self._cond.notify()

    def abort_all(self, reason: str) -> None:
        with self._cond:
            for seq in list(self._waiting):
                self.abort(seq, reason)
            for row in list(self._running):
                self.abort(row.seq, reason)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="leaplm-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, abort the rest, and end the loop thread."""
        with self._cond:
            self._closed = True
        self.abort_all("the server is shutting down")
        with self._cond:
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def close_admission(self) -> None:
        with self._cond:
            self._closed = True

    # --- loop thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._running and not self._closed:
                    self._cond.wait()
                if self._closed and not self._waiting and not self._running:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not kill the server
                log.exception("engine step failed")
                for i in reversed(range(len(self._running))):
                    self._release(i, SeqOutput(self._running[i].seq.request_id, error=f"engine error: {e}"))

    def step(self) -> bool:
        """One step: drop aborted requests, admit waiting ones, then propose/score/verify/commit over all rows.
        Returns False when there was nothing to run."""
        self._reap()
        self._admit()
        rows = self._running
        if not rows:
            return False
        n = len(rows)
        ts = time.perf_counter()

        # 1. propose: one K for the step, each row drafts up to min(K, its own cap); seeded rows draft their cap
        rooms = [max(0, self.max_len - len(r.req.tokens) - 1) for r in rows]
        # A row's first step drafts nothing: its first token then costs one target forward, not the draft's
        # catching up with the prompt as well (time to first token).
        specs = [RowSpec(max(0, min(r.cap, room, r.req.remaining - 1))
                         if r.proposer is not None and r.req.stats.target_forwards else 0,
                         r.acceptance.rate, self._propose_cost.get(r.req.stats.method, 0.0), self._catchup_s(r))
                 for r, room in zip(rows, rooms)]
        fixed = [r.fixed_k for r in rows]
        K = self.policy.choose([sp for sp, f in zip(specs, fixed) if not f])
        K = max([K] + [sp.cap for sp, f in zip(specs, fixed) if f])
        K = min(K, min(rooms))                             # every row gets 1 + K slots written
        proposals = [self._propose(i, r, min(K, spec.cap)) for i, (r, spec) in enumerate(zip(rows, specs))]
        propose_s = sum(dt for _, dt in proposals)
        proposals = [p for p, _ in proposals]
        tp = time.perf_counter()

        # 2. score: one forward over [n, T] for the chains; a tree row's block there is its last token alone
        chain = [p if p is not None and p.parents is None else None for p in proposals]
        T = 1 + max((p.k for p in chain if p is not None), default=0)
        block = torch.zeros(n, T, dtype=torch.long)                                  # [n, T]
        for i, (r, p) in enumerate(zip(rows, chain)):
            block[i, 0] = r.req.tokens[-1]
            if p is not None:
                block[i, 1 : 1 + p.k] = p.tokens.to("cpu")
        logits = self.model(block.to(self.model.device), self.cache)                 # [n, T, V]
        tv = time.perf_counter()
        self.policy.costs.observe(n, T, tv - tp)

        # 3. verify + 4. commit, row by row (tree rows: scored and verified here, one forward each)
        drafted, accepted, emitted, outputs, failed = [], [], [], [], {}
        for i, (r, p) in enumerate(zip(rows, proposals)):
            d = p.k if p is not None else 0
            try:
                if p is not None and p.parents is not None:
                    result, row_logits = self._score_verify_tree(i, r, p)              # [T_tree, V]
                else:
                    row_logits = logits[i, : 1 + d]                                   # [1 + k_i, V]
                    result = verify_chain(r.req, p, r.proc, row_logits)
                if p is not None:
                    r.proposer.observe(p, result, extra_logits(p, row_logits))
                    r.acceptance.observe(d, result.accepted)
                    self._method_acceptance.setdefault(r.req.stats.method, AcceptanceEstimate(decay=0.98)).observe(
                        d, result.accepted)
                chunk = commit(r.req, result, row_logits, d, self.cache, row=i)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                log.exception("request %s failed in a step", r.seq.request_id)
                failed[i] = f"engine error: {type(e).__name__}: {e}"
                d, result, chunk = 0, None, None
            drafted.append(d)
            accepted.append(result.accepted if result is not None else 0)
            emitted.append(len(chunk.token_ids) if chunk is not None else 0)
            outputs.append(chunk)
        te = time.perf_counter()
        for r in rows:
            r.req.stats.score_s += tv - tp
            r.req.stats.decode_s += te - ts
        self.current_k = K
        self.steps += 1
        for i in reversed(range(n)):
            if i in failed:
                self._release(i, SeqOutput(rows[i].seq.request_id, error=failed[i]))
                continue
            chunk = finish_chunk(rows[i].req, outputs[i])
            if chunk.finish_reason is not None:
                self._release(i, SeqOutput(rows[i].seq.request_id, chunk, time=te))
            elif chunk.text or chunk.token_ids:
                self._emit(rows[i].seq, SeqOutput(rows[i].seq.request_id, chunk, time=te))
        if self.observer is not None:
            self.observer.on_step(StepReport(n, K, T, drafted, accepted, emitted, propose_s, tv - tp, te - ts))
        return True

    def _catchup_s(self, r: _Row) -> float:
        """Seconds a draft model needs to prefill what it has not seen (a row that has not drafted yet: its whole
        context), spread over the steps the request has left: near the end of a request it does not pay."""
        lag = getattr(r.proposer, "lag", None)
        if lag is None or not self.draft_prefill_s_per_token:
            return 0.0
        steps_left = max(1.0, r.req.remaining / expected_tokens(r.acceptance.rate, max(1, r.cap)))
        return lag(len(r.req.tokens)) * self.draft_prefill_s_per_token / steps_left

    def _row_cache(self, i: int):
        """Row i as a batch-1 cache (the cache itself when it has one row)."""
        return self.cache if self.cache.batch_size == 1 else self.cache.row_view(i)

    def _propose(self, i: int, r: _Row, k: int) -> tuple[Proposal | None, float]:
        """Row i's proposal of at most k tokens (None: nothing drafted) and the seconds it took."""
        if k <= 0:
            return None, 0.0
        t = time.perf_counter()
        prop = r.proposer.propose(ProposeContext(r.req.tokens, k, r.req.params, r.proc, r.req.generator,
                                                 r.req.presence, self._row_cache(i)))
        dt = time.perf_counter() - t
        r.req.stats.propose_s += dt
        if prop.parents is None and prop.k > k:
            prop = Proposal(prop.tokens[:k], prop.q[:k] if prop.q is not None else None)
        if prop.k == 0:
            return None, dt
        # Seconds per drafted token, per method (every request of a method drafts with the same model), the
        # draft's catching up on tokens it has not seen included: what drafting really costs here.
        per, m = dt / prop.k, r.req.stats.method
        old = self._propose_cost.get(m)
        self._propose_cost[m] = per if old is None else 0.9 * old + 0.1 * per
        return prop, dt

    def _score_verify_tree(self, i: int, r: _Row, p: Proposal):
        """A tree proposal of row i: its own forward with the tree mask (after the batched one, whose slots for this
        row it overwrites), then the tree verifier. Returns (result, logits [T_tree, V])."""
        tb = tree_block(r.req, p)
        logits = self.model(tb.ids.unsqueeze(0), self._row_cache(i), tree_mask=tb.layout.mask,
                            position_offsets=tb.layout.depths)[0]                       # [T_tree, V]
        return verify_tree(r.req, p, r.proc, logits, tb.layout), logits

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step in the calling thread until nothing is waiting or running (tests, offline batches)."""
        for _ in range(max_steps):
            busy = self.step()
            if not busy and not self._waiting:
                return
        raise RuntimeError(f"not idle after {max_steps} steps")

    # --- joining and leaving ----------------------------------------------------------------------------------
    def _reap(self) -> None:
        for i in reversed(range(len(self._running))):
            seq = self._running[i].seq
            if seq.aborted:
                self._release(i, SeqOutput(seq.request_id, error=seq.abort_reason or "aborted"))

    def _admit(self) -> None:
        while len(self._running) < self.max_batch:
            with self._cond:
                if not self._waiting:
                    return
                seq = self._waiting.popleft()
            if seq.aborted:
                self._emit(seq, SeqOutput(seq.request_id, error=seq.abort_reason or "aborted"))
                continue
            try:
                self._join(seq)
            except Exception as e:  # noqa: BLE001 - a request that cannot start fails alone
                log.exception("request %s could not start", seq.request_id)
                self.cache.truncate(0, len(self._running))
                self._emit(seq, SeqOutput(seq.request_id, error=f"could not start: {e}"))

    def _join(self, seq: SeqRequest) -> None:
        """Prefill seq into row n = len(running) (all prompt tokens but the last, which opens its first step)."""
        eng = self.engine
        method = seq.method or self.default_method
        factory = self.proposer_factory(method)
        cap = (seq.k if seq.k is not None else eng.spec.k) if factory is not None else 0
        ids = seq.prompt_ids
        req = new_request(ids, seq.params, tokenizer=eng.tokenizer, eos_token_ids=eng.target.eos_token_ids,
                          vocab_size=self.model.vocab_size, device=self.model.device, method=method, k=cap)
        row = len(self._running)
        self.cache.truncate(0, row)
        t0 = time.perf_counter()
        prompt_lps = None
        if len(ids) > 1:
            view = self.cache.row_view(row) if self.cache.batch_size > 1 else self.cache
            want = seq.prompt_logprobs is not None
            logits = self.model(torch.tensor([ids[:-1]], device=self.model.device), view, last_only=not want)
            self.cache.advance(len(ids) - 1, row)
            if want:
                prompt_lps = [None] + prompt_token_logprobs(logits[0], ids[1:], seq.prompt_logprobs)
        elif seq.prompt_logprobs is not None:
            prompt_lps = [None]
        req.stats.prefill_s = time.perf_counter() - t0
        proposer = factory(self.max_len) if factory is not None else None
        # A seeded sampling request drafts a fixed K: its random draws then do not depend on the batch it shares
        # steps with or on measured timings, so the same seed gives the same text (greedy output never depends on K).
        fixed = proposer is not None and not seq.params.greedy and seq.params.seed is not None
        seen = self._method_acceptance.get(method)
        acceptance = AcceptanceEstimate.seeded(seen.rate) if seen is not None else AcceptanceEstimate()
        self._running.append(_Row(seq, req, LogitsProcessor(seq.params), proposer, cap, fixed, acceptance))
        if prompt_lps is not None:
            self._emit(seq, SeqOutput(seq.request_id, StreamChunk("", []), prompt_logprobs=prompt_lps))

    def _release(self, i: int, out: SeqOutput) -> None:
        """Remove running row i (its last output is `out`), keeping rows [0, n) dense."""
        rows = self._running
        last = len(rows) - 1
        seq = rows[i].seq
        if i != last:
            self.cache.move_row(last, i)
            rows[i] = rows[last]
        rows.pop()
        self.cache.truncate(0, last)
        self._emit(seq, out)

    @staticmethod
    def _emit(seq: SeqRequest, out: SeqOutput) -> None:
        try:
            seq.on_output(out)
        except Exception:  # noqa: BLE001 - a listener's failure is its own
            log.exception("on_output of %s failed", seq.request_id)

    # --- cost calibration -------------------------------------------------------------------------------------
    def calibrate(self, ctx: int = 256, repeats: int = 2) -> None:
        """Measure batched forward costs at n in 1, 2, 4, ... max_batch rows and T = 1 .. K + 1 tokens (before
        the loop starts; live steps keep refreshing them), and a draft model's prefill cost per token."""
        if self._running:
            raise RuntimeError("calibrate() before serving requests")
        ctx = max(1, min(ctx, self.max_len // 2))
        k = self.engine.spec.k
        ns = sorted({min(self.max_batch, 1 << i) for i in range(self.max_batch.bit_length() + 1)})
        dev = self.model.device
        for n in ns:
            for r in range(n):
                self.cache.lengths[r] = ctx
            for _ in range(repeats):
                for T in range(1, min(k + 1, self.max_len - ctx) + 1):
                    t = time.perf_counter()
                    self.model(torch.zeros(n, T, dtype=torch.long, device=dev), self.cache)
                    self.policy.costs.observe(n, T, time.perf_counter() - t)
            for r in range(n):
                self.cache.lengths[r] = 0
        if self.engine.draft is not None:
            draft = self.engine.draft.model
            n_tok = max(1, min(ctx, draft.max_len))
            cache = draft.new_cache(1, n_tok)
            best = float("inf")
            for _ in range(repeats + 1):
                cache.lengths[0] = 0
                t = time.perf_counter()
                draft(torch.zeros(1, n_tok, dtype=torch.long, device=draft.device), cache, last_only=True)
                best = min(best, time.perf_counter() - t)
            self.draft_prefill_s_per_token = best / n_tok


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """logits [L, V] at prompt positions 0..L-1 -> the target's logprob of targets[j] (the token at j + 1)."""
    lp = torch.log_softmax(logits.float(), -1)                                 # [L, V]
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).view(-1, 1)).view(-1).tolist()
    tops = [[] for _ in targets]
    if top:
        vals, idx = lp.topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(targets, chosen, tops)]

"""The one batched step: propose, score, verify, commit over the rows of a batch.

Every caller goes through `Batch.step`: Engine.generate and Engine.stream (a batch of one), `leaplm generate -n N`
(N rows), `leaplm bench` and the server's scheduler (a batch of up to max_batch rows, which requests join and
leave between steps). A step over the n running rows:

  1. propose  the K policy (engine/kpolicy/policy.py) plans the step: one K, each row drafting k_i = min(K, its cap, its
              room); cheap proposers (n-gram, suffix) propose at their cap inside the plan, so the policy knows
              what they have, and are trimmed to K after. Proposers that share a group (the draft model) draft for
              all their rows in one call, one batched draft forward per draft position; the others row by row
  2. score    ONE target forward over [n, 1 + max k_i] for the chain rows: row i is [its last token, its drafts,
              padding]; a tree row (Proposal.parents set) is scored by its own forward with the tree mask over a
              batch-1 view of its cache row (engine/tree_step.py; when every row is a tree row the batched forward
              is skipped)
  3. verify   per row, the verifier its request runs (engine/verification.py) on that row's logits (a constrained
              row's masked by its grammar first, its drafts cut to the grammar before step 2: engine/constrain.py)
  4. commit   per row, engine/commit.py: tokens, stop ids and strings, max_new_tokens, logprobs, stats, and the
              row's cache length. Only commit changes state.

Padding is harmless: a row commits only its accepted + 1 slots, and causal attention means the logits of its real
positions never see the padding after them.

Prefill: a joining row's prompt (all its tokens but the last, which opens its first step) goes into the cache
before the row decodes. Without a token budget it is prefilled whole when the row joins. With one
(max_num_batched_tokens, vLLM's name) each step first spends what the decoding rows leave of the budget on the
prompts of the rows still prefilling, in order, then decodes: a long prompt delays the running streams by one
chunk per step instead of by its whole prefill.

Rows: decoding rows occupy cache rows [0, decoding), rows still prefilling [decoding, n). A row that leaves has
another moved into its place (KVCache.move_row) so both ranges stay dense.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import SamplingParams, SpecConfig, StructuredOutput
from ..propose.base import Proposal, ProposeContext, Proposer, ProposerFactory
from ..propose.prediction import with_prediction
from ..sampling import LogitsProcessor
from .kpolicy.calibrate import calibrate  # noqa: F401  (re-exported: the engine's and the scheduler's calibration)
from .commit import commit, finish_chunk, new_request
from .constrain import RowConstraint, constrain_proposal, dead_end, forced_proposal, masked
from .kpolicy.estimates import Estimates
from .kpolicy.policy import KPolicy, RowStep, StepPlan
from .request import StreamChunk, TokenLogprob
from .row import Row
from .stats import StepClock
from .tree_step import extra_logits, score_tree
from .verification import verify_chain, wants_q

log = logging.getLogger(__name__)

MIN_CHUNK = 32     # prompt tokens a step prefills at least, however many the decoding rows take of the budget
PAD_SLACK = 64     # cache slots (and positions) past max_len for the padding of a row near its end: the largest K


class StepHost(Protocol):
    """What a Batch takes from its engine (engine.Engine is one): read once, when the batch is made."""
    model: object                               # the target CausalLM (models/base.py)
    target: object                              # its LoadedModel (eos_token_ids)
    tokenizer: object
    spec: SpecConfig                            # the default method, K and adaptive_k
    max_model_len: int
    max_num_batched_tokens: int | None
    estimates: Estimates                        # costs and acceptance, shared by every batch of the engine

    def proposer_factory(self, method: str) -> ProposerFactory | None: ...

    def grammar_state(self, spec: StructuredOutput): ...       # a constrained request's grammar (structured/)


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
    score_s: float                  # target forwards: the batched one and any tree row's own
    verify_s: float
    commit_s: float
    step_s: float


@dataclass
class RowOutput:
    """What one step produced for one row: a chunk (finish_reason set on the last), or an error that ended it."""
    row: Row
    chunk: StreamChunk | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.chunk is not None and self.chunk.finish_reason is not None)


@dataclass
class StepOutcome:
    outputs: list[RowOutput]         # one per row that ran, finished rows already removed from the batch
    report: StepReport | None        # None when no row decoded (the step only prefilled)
    time: float                      # perf_counter at the end of the step


@dataclass
class Scored:
    """The batched forward of a step's chain rows."""
    logits: torch.Tensor | None      # [n, T, V] (None: every row was a tree row, or failed)
    hidden: torch.Tensor | None      # [n, T, hid] when a row's proposer reads the target's features
    T: int                           # 1 + the longest chain draft
    failed: dict[int, str] = field(default_factory=dict)   # row -> the error that ended it (proposing or scoring)


class Batch:
    """Rows of one target KV cache stepped together (see the module docstring)."""

    def __init__(self, engine: StepHost, max_rows: int = 1):
        self.model = engine.model
        self.tokenizer = engine.tokenizer
        self.eos_token_ids = engine.target.eos_token_ids
        self.spec = engine.spec
        self.proposer_factory = engine.proposer_factory
        self.grammar_state = engine.grammar_state
        self.estimates: Estimates = engine.estimates
        self.max_rows = max_rows
        self.max_len = engine.max_model_len
        # slots past max_len for padding (positions too, where the model has them): see the plan's room
        self.cache = self.model.new_cache(max_rows, min(self.max_len + PAD_SLACK, self.model.max_len))
        self.policy = KPolicy(self.estimates, enabled=self.spec.adaptive_k, max_len=self.max_len)
        self.rows: list[Row] = []                        # row i of the cache <-> rows[i]
        self.decoding = 0                                # rows [0, decoding) decode, the rest still prefill
        self.max_num_batched_tokens = engine.max_num_batched_tokens
        full_step = max_rows * (1 + self.spec.k) + MIN_CHUNK
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < full_step:
            # every running row decodes each step; prompts get only what is left (at least MIN_CHUNK), so a full
            # batch admits new requests a few prompt tokens per step (measured: minute-long TTFTs at 64 rows / 96)
            log.warning("max_num_batched_tokens=%d is below what %d decoding rows with K=%d take plus a chunk (%d): "
                        "a full batch prefills new prompts %d tokens per step", self.max_num_batched_tokens,
                        max_rows, self.spec.k, full_step, MIN_CHUNK)
        self.groups: dict[str, object] = {}              # method -> ProposerGroup of rows that draft together
        self.current_k = 0
        self.steps = 0

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.max_rows

    # --- joining and leaving -------------------------------------------------------------------------------------
    def join(self, ids: list[int], params: SamplingParams, method: str | None = None, k: int | None = None,
             prompt_logprobs: int | None = None, tag: object = None,
             adaptive_k: bool | None = None) -> tuple[Row, list[TokenLogprob | None] | None]:
        """Prefill a request into row n (all prompt tokens but the last, which opens its first step).
        Returns the row and, when asked for, the prompt's logprobs (position 0 has none)."""
        method = method or self.spec.method
        factory = self.proposer_factory(method)
        cap = (k if k is not None else self.spec.k) if factory is not None else 0
        req = new_request(ids, params, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids,
                          vocab_size=self.model.vocab_size, device=self.model.device, method=method, k=cap,
                          verifier=self.spec.verifier)
        if params.structured is not None:
            req.grammar = self.grammar_state(params.structured)
        i = len(self.rows)
        self.cache.truncate(0, i)
        t0 = time.perf_counter()
        prompt_lps = None
        # prefilled at once unless a budget chunks it; prompt logprobs come back with the join, so whole too
        whole = self.max_num_batched_tokens is None or prompt_logprobs is not None
        proposer = self._new_proposer(method, factory) if factory is not None else None
        if params.prediction is not None:        # drafted ahead of the method's proposer (propose/prediction.py)
            proposer, cap = with_prediction(proposer, cap, params.prediction, self.tokenizer, len(ids), req.tokens,
                                            self.model.device, self.groups)
            req.stats.k = cap
        try:
            if len(ids) > 1 and whole:
                want = prompt_logprobs is not None
                feats = proposer is not None and proposer.reads_hidden
                out = self._forward(torch.tensor([ids[:-1]], device=self.model.device), self._row_cache(i),
                                    feats, last_only=not want)
                logits = out.logits if feats else out
                if feats:
                    proposer.observe_hidden(0, out.hidden[0])
                self.cache.advance(len(ids) - 1, i)
                if want:
                    prompt_lps = [None] + prompt_token_logprobs(logits[0], ids[1:], prompt_logprobs)
            elif prompt_logprobs is not None:
                prompt_lps = [None]
        except Exception:
            self.cache.truncate(0, i)
            if proposer is not None:
                proposer.close()
            raise
        req.stats.prefill_s = time.perf_counter() - t0
        row = Row(req, LogitsProcessor(params), proposer, cap, adaptive_k is False,
                  self.policy.new_acceptance(method, proposer is not None and proposer.bursty), tag=tag,
                  prefilled=len(ids) - 1 if whole else 0)
        self.rows.append(row)
        if not row.prefilling and self.decoding == i:
            self.decoding += 1
        return row, prompt_lps

    def remove(self, i: int) -> Row:
        """Remove row i, keeping the decoding rows [0, decoding) and the prefilling ones [decoding, n) dense."""
        rows = self.rows
        last = len(rows) - 1
        row = rows[i]
        if row.proposer is not None:                     # a grouped proposer frees its row of the group
            row.proposer.close()
        hole = i
        if i < self.decoding:
            d = self.decoding - 1
            self._move(d, i)                             # the last decoding row fills the hole
            hole = d
            self.decoding -= 1
            if last > d:                                 # the first prefilling row moves down, the last into its place
                self._move(d + 1, d)
                hole = d + 1
        self._move(last, hole)
        rows.pop()
        self.cache.truncate(0, last)
        return row

    def _move(self, src: int, dst: int) -> None:
        if src != dst:
            self.cache.move_row(src, dst)
            self.rows[dst] = self.rows[src]


    # --- the step ----------------------------------------------------------------------------------------------
    def step(self) -> StepOutcome | None:
        """One step over every row; rows that finished or failed are removed. None when no row runs."""
        if not self.rows:
            return None
        clock = StepClock()
        failed = self._prefill()
        rows = self.rows[: self.decoding]
        n = len(rows)
        if not n:
            return StepOutcome(failed, None, time.perf_counter())
        clock.decoding()                         # the policy measures steps from here

        # 1. propose: one K for the step, each row drafts up to min(K, its own cap). A sampled row's tokens are
        # fixed by its seed and their positions (sampling/positional.py): K never changes what a seed produces.
        # A constrained row whose grammar forces the next tokens drafts them instead, for free (engine/constrain.py).
        forced = self._forced(rows)
        plan = self.policy.plan(rows, lambda i, cap: self._propose(i, rows[i], cap, clock)[0], self._room(rows),
                                free=frozenset(forced))
        errors: dict[int, str] = {}                      # rows whose proposer or forward failed: they end
        proposals = self._proposals(plan, clock, errors)
        self.policy.proposed(proposals)
        proposals, constraints = self._constrain(rows, proposals, forced, errors)

        # 2. score: one forward over [n, T] for the chains; a tree row's block there is its last token alone
        scored = self._score_chains(rows, proposals, clock, errors)

        # 3. verify + 4. commit, row by row (tree rows: scored and verified here, one forward each)
        outputs, done = [], []
        for i, (r, p) in enumerate(zip(rows, proposals)):
            rc = constraints.get(i)
            end = dead_end(r.req, rc) if rc is not None else None       # the grammar admits no token: it ends
            if i in scored.failed:
                out, d = RowOutput(r, error=scored.failed[i]), None
            elif end is not None:
                out, d = RowOutput(r, end), None
            else:
                out, d = self._verify_commit(i, r, p, scored, clock, rc)
            outputs.append(out)
            done.append(d)
        clock.end(rows)
        self.current_k = plan.k
        self.steps += 1
        self.policy.observe(rows, plan, done, clock.policy_seconds(),
                            catchup_s=sum(p.catchup_s for p in proposals if p is not None), timed=not forced)
        for i in reversed(range(n)):
            out = outputs[i]
            if out.chunk is not None:
                finish_chunk(out.row.req, out.chunk)
            if out.finished:
                self.remove(i)
        report = StepReport(n, plan.k, scored.T, [d.drafted if d else 0 for d in done],
                            [d.accepted if d else 0 for d in done],
                            [len(o.chunk.token_ids) if o.chunk is not None else 0 for o in outputs],
                            clock.propose, clock.score, clock.verify, clock.commit, clock.total)
        return StepOutcome(failed + outputs, report, clock.stop)

    def _room(self, rows: list[Row]) -> int:
        """The largest K the cache fits: every row gets 1 + K slots written, padding included, so K must fit the
        fullest row. Each row's drafts are capped by its own room (the plan), so with PAD_SLACK slots past max_len
        a row near its end caps only itself; only where the model has no positions left for the padding does it
        cap the step."""
        return self.cache.max_len - 1 - max(len(r.req.tokens) - 1 for r in rows)

    def _forced(self, rows: list[Row]) -> dict[int, Proposal]:
        """Constrained rows whose grammar forces the next tokens -> those tokens as the row's proposal (within the
        cache's room for every row, the row's own room and its remaining tokens)."""
        if not self.spec.forced_tokens or not any(r.req.grammar is not None for r in rows):
            return {}
        fit = self._room(rows)
        out = {}
        for i, r in enumerate(rows):
            limit = min(fit, self.max_len - len(r.req.tokens) - 1, r.req.remaining - 1)
            try:
                p = forced_proposal(r.req, limit, self.model.device) if r.req.grammar is not None and limit > 0 \
                    else None
            except Exception:  # noqa: BLE001 - the row's grammar fails again where it is constrained, and ends there
                p = None
            if p is not None:
                out[i] = p
        return out

    @staticmethod
    def _constrain(rows: list[Row], proposals: list[Proposal | None], forced: dict[int, Proposal],
                   failed: dict[int, str]) -> tuple[list[Proposal | None], dict[int, RowConstraint]]:
        """The forced rows' proposals put in; every constrained row's proposal cut to its grammar, with the masks of
        its verified positions (a row whose grammar fails is put in `failed`, its proposal dropped)."""
        proposals = [forced.get(i, p) for i, p in enumerate(proposals)]
        constraints: dict[int, RowConstraint] = {}
        for i, r in enumerate(rows):
            if r.req.grammar is not None and i not in failed:
                try:
                    proposals[i], constraints[i] = constrain_proposal(r.req, proposals[i], forced=i in forced)
                except Exception as e:  # noqa: BLE001 - one request's failure is its own
                    log.info("a request's grammar failed: %s", e)
                    failed[i] = engine_error(e)
                    proposals[i] = None
        return proposals, constraints

    def _proposals(self, plan: StepPlan, clock: StepClock, failed: dict[int, str]) -> list[Proposal | None]:
        """Each row's proposal of at most plan.asked[i] tokens: the rows that proposed in the plan trimmed to it,
        the others asked now (a row whose proposer failed is put in `failed`)."""
        proposals, seconds = self._propose_all([0 if i in plan.early else k for i, k in enumerate(plan.asked)],
                                               failed)
        clock.propose += seconds
        for i, p in plan.early.items():
            proposals[i] = self._trim(p, plan.asked[i]) if p is not None and plan.asked[i] else None
        return proposals

    def _score_chains(self, rows: list[Row], proposals: list[Proposal | None], clock: StepClock,
                      failed: dict[int, str]) -> Scored:
        """The one batched target forward over [n, T]: row i is [its last token, its chain's drafts, padding].
        When it fails (a C++ exception, a failed llama_decode), each row is scored alone instead: the rows that
        fail alone end with the error, the others go on (their logits do not depend on the batch where the
        backend is batch-invariant, so they commit what the batched forward would have given them)."""
        t = time.perf_counter()
        chain = [p if p is not None and p.parents is None else None for p in proposals]
        T = 1 + max((p.k for p in chain if p is not None), default=0)
        if all(i in failed or (p is not None and p.parents is not None) for i, p in enumerate(proposals)):
            return Scored(None, None, T, failed)
        block = torch.zeros(len(rows), T, dtype=torch.long)                              # [n, T]
        for i, (r, p) in enumerate(zip(rows, chain)):
            block[i, 0] = r.req.tokens[-1]
            if p is not None:
                block[i, 1: 1 + p.k] = p.tokens.to("cpu")
        feats = any(r.reads_hidden for r in rows)
        # a model taking ragged rows (libllama) skips the padding, and a tree row's block (scored apart)
        ragged = {"row_tokens": [0 if p is not None and p.parents is not None else 1 + (c.k if c is not None else 0)
                                 for p, c in zip(proposals, chain)]} if getattr(self.model, "ragged", False) else {}
        try:
            out = self._forward(block.to(self.model.device), self.cache, feats, **ragged)
        except Exception as e:  # noqa: BLE001 - the rows that cause it end, not the batch
            log.warning("a batched forward of %d rows failed (%s: %s): scoring each row alone", len(rows),
                        type(e).__name__, e)
            scored = self._score_alone(rows, block, proposals, feats, failed)
            clock.batched_score(time.perf_counter() - t)
            return scored
        logits, hidden = (out.logits, out.hidden) if feats else (out, None)           # [n, T, V], [n, T, hid]
        seconds = time.perf_counter() - t
        self.estimates.costs.observe(len(rows), T, seconds)
        clock.batched_score(seconds)
        return Scored(logits, hidden, T, failed)

    def _score_alone(self, rows: list[Row], block: torch.Tensor, proposals: list[Proposal | None], feats: bool,
                     failed: dict[int, str]) -> Scored:
        """block [n, T]: each chain row's real tokens scored by a forward of its own (what a failed batched forward
        falls back to); a row whose forward fails too is put in `failed`."""
        n, T = block.shape
        logits = hidden = None
        for i, p in enumerate(proposals):
            if i in failed or (p is not None and p.parents is not None):
                continue                                # failed already; a tree row is scored on its own anyway
            real = 1 + (p.k if p is not None else 0)
            try:
                out = self._forward(block[i: i + 1, :real].to(self.model.device), self._row_cache(i), feats)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                log.exception("a request failed in its forward")
                failed[i] = engine_error(e)
                continue
            lg, hd = (out.logits, out.hidden) if feats else (out, None)                # [1, real, V], [1, real, hid]
            if logits is None:
                logits = lg.new_zeros(n, T, lg.shape[-1])                              # [n, T, V]
                hidden = hd.new_zeros(n, T, hd.shape[-1]) if hd is not None else None  # [n, T, hid]
            logits[i, :real] = lg[0]
            if hidden is not None:
                hidden[i, :real] = hd[0]
        return Scored(logits, hidden, T, failed)

    def _verify_commit(self, i: int, r: Row, p: Proposal | None, scored: Scored, clock: StepClock,
                       rc: RowConstraint | None = None) -> tuple[RowOutput, RowStep | None]:
        """Stages 3 and 4 for row i (a tree row scored here first; a constrained row, rc, verified against its
        masked logits). Returns its output and what it did (None: it failed, its error in the output)."""
        out = RowOutput(r)
        d = p.k if p is not None else 0
        t0 = time.perf_counter()
        try:
            if p is not None and p.parents is not None:
                tree = score_tree(self._forward, self._row_cache(i), r.req, p, r.proc, r.reads_hidden,
                                  r.proposer.samples, constrain=(lambda x: masked(x, rc)) if rc is not None else None)
                self.estimates.costs.observe(1, tree.block_len, tree.score_s)
                result, row_logits, row_hidden, score_s = tree.result, tree.logits, tree.hidden, tree.score_s
                kept = [0] + [j + 1 for j in result.path]
            else:
                row_logits = scored.logits[i, : 1 + d]                                    # [1 + k_i, V]
                result = verify_chain(r.req, p, r.proc, masked(row_logits, rc) if rc is not None else row_logits)
                row_hidden = scored.hidden[i] if scored.hidden is not None else None
                kept, score_s = list(range(1 + result.accepted)), 0.0
            t1 = time.perf_counter()
            if r.reads_hidden:              # the target's features of the committed block tokens
                r.proposer.observe_hidden(len(r.req.tokens) - 1, row_hidden[kept])
            forced = rc is not None and rc.forced                    # the grammar's drafts, not the proposer's
            if p is not None and not forced:
                r.proposer.observe(p, result, extra_logits(p, row_logits))
            out.chunk = commit(r.req, result, row_logits, d, self.cache, row=i, forced=forced,
                               predicted=p is not None and p.predicted)
            clock.row(r.req.stats, score_s, t1 - t0 - score_s, time.perf_counter() - t1)
        except Exception as e:  # noqa: BLE001 - one request's failure is its own
            log.exception("a request failed in a step")
            out.error = engine_error(e)
            return out, None
        if forced:                                   # nothing the row's proposer drafted: not its acceptance
            return out, RowStep(0, 0, 1)
        return out, RowStep(d, result.accepted, row_logits.shape[0], p.match if p is not None else None)

    def _prefill(self) -> list[RowOutput]:
        """Spend this step's prefill budget on the rows still prefilling, in order; a row whose prompt is in is
        promoted to decoding (it decodes in this step). Returns the rows whose prefill failed (removed)."""
        budget = None
        if self.max_num_batched_tokens is not None:
            # what the decoding rows leave of the budget (each writes 1 + K tokens), at least a small chunk
            decode = self.decoding * (1 + self.current_k)
            budget = max(self.max_num_batched_tokens - decode, min(self.max_num_batched_tokens, MIN_CHUNK))
        failed = []
        while self.decoding < len(self.rows) and (budget is None or budget > 0):
            i = self.decoding
            r = self.rows[i]
            ids = r.req.prompt_ids
            n = len(ids) - 1 - r.prefilled
            if budget is not None:
                n = min(n, budget)
                budget -= n
            if n > 0:
                t0 = time.perf_counter()
                try:
                    feats = r.reads_hidden
                    out = self._forward(torch.tensor([ids[r.prefilled: r.prefilled + n]], device=self.model.device),
                                        self._row_cache(i), feats, last_only=True)
                    if feats:
                        r.proposer.observe_hidden(r.prefilled, out.hidden[0])
                except Exception as e:  # noqa: BLE001 - one request's failure is its own
                    log.exception("a request failed in its prefill")
                    failed.append(RowOutput(self.remove(i), error=engine_error(e)))
                    continue
                self.cache.advance(n, i)
                r.prefilled += n
                r.req.stats.prefill_s += time.perf_counter() - t0
            if not r.prefilling:
                self.decoding += 1
        return failed


    def catchup_s(self, r: Row) -> float:
        """The K policy's price of row r's draft model catching up (kpolicy.KPolicy.catchup_s)."""
        return self.policy.catchup_s(r)

    def _row_cache(self, i: int):
        """Row i as a batch-1 cache (the cache itself when it has one row)."""
        return self.cache if self.cache.batch_size == 1 else self.cache.row_view(i)

    def _new_proposer(self, method: str, factory: ProposerFactory) -> Proposer:
        """A proposer for a joining row; one that can draft for many rows at once shares this batch's group."""
        if method not in self.groups:
            self.groups[method] = factory.new_group(self.max_rows, self.max_len)
        return factory(self.max_len, self.groups[method])

    def _context(self, i: int, r: Row, k: int) -> ProposeContext:
        return ProposeContext(r.req.tokens, k, r.req.params, r.proc, r.req.generator, r.req.presence,
                              self._row_cache(i), r.req.seed, wants_q(r.req))

    def _propose_all(self, asked: list[int], failed: dict[int, str] | None = None
                     ) -> tuple[list[Proposal | None], float]:
        """Every row's proposal (None: nothing drafted) of at most asked[i] tokens, and the seconds proposing took.
        Rows whose proposers share a group draft together (one call, batched forwards); the others one by one.
        A group whose call fails drafts row by row; a row whose proposer fails alone is put in `failed`."""
        failed = {} if failed is None else failed
        proposals: list[Proposal | None] = [None] * len(asked)
        groups: dict[int, list[int]] = {}
        total = 0.0
        for i, (r, k) in enumerate(zip(self.rows, asked)):
            if k <= 0:
                continue
            if r.proposer.group is not None:
                groups.setdefault(id(r.proposer.group), []).append(i)
            else:
                try:
                    proposals[i], dt = self._propose(i, r, k)
                except Exception as e:  # noqa: BLE001 - one request's failure is its own
                    log.exception("a request failed proposing")
                    failed[i] = engine_error(e)
                    continue
                total += dt
        for idx in groups.values():
            t = time.perf_counter()
            group = self.rows[idx[0]].proposer.group
            try:
                props = group.propose_rows([self.rows[i].proposer for i in idx],
                                           [self._context(i, self.rows[i], asked[i]) for i in idx])
            except Exception as e:  # noqa: BLE001 - the rows that cause it end, not the group
                log.warning("drafting for %d rows together failed (%s: %s): drafting row by row", len(idx),
                            type(e).__name__, e)
                props = []
                for i in list(idx):
                    try:
                        props.append(group.propose_rows([self.rows[i].proposer],
                                                        [self._context(i, self.rows[i], asked[i])])[0])
                    except Exception as e1:  # noqa: BLE001 - one request's failure is its own
                        log.exception("a request failed proposing")
                        failed[i] = engine_error(e1)
                idx = [i for i in idx if i not in failed]
            dt = time.perf_counter() - t
            total += dt
            drafted = sum(p.k for p in props)
            for i, p in zip(idx, props):
                r = self.rows[i]
                r.req.stats.propose_s += dt * p.k / max(1, drafted)    # the group's time shared by drafted tokens
                proposals[i] = self._trim(p, asked[i])
            if drafted:
                # per drafted token, without the catching up on unseen tokens (priced apart: catchup_s): counted
                # here, every step after a stretch at K = 0 would price drafting dearer and keep K at 0
                drafting = max(0.0, dt - sum(p.catchup_s for p in props))
                self.estimates.observe_propose(self.rows[idx[0]].req.stats.method, drafting / drafted, rows=len(idx))
        return proposals, total

    @staticmethod
    def _trim(prop: Proposal, k: int) -> Proposal | None:
        """At most k tokens of prop: a chain's first k, a tree's first k nodes (parents come first, so they are a
        tree; a tree with extra tokens is kept whole). Proposals are cut to the step's K here, and only here."""
        if prop.k > k and prop.extra is None:
            parents = prop.parents[:k] if prop.parents is not None else None
            prop = dataclasses.replace(prop, tokens=prop.tokens[:k], q=prop.q[:k] if prop.q is not None else None,
                                       parents=parents)
        return prop if prop.k > 0 else None

    def _propose(self, i: int, r: Row, k: int, clock: StepClock | None = None) -> tuple[Proposal | None, float]:
        """Row i's proposal of at most k tokens (None: nothing drafted) and the seconds it took."""
        if k <= 0:
            return None, 0.0
        t = time.perf_counter()
        prop = self._trim(r.proposer.propose(self._context(i, r, k)), k)
        dt = time.perf_counter() - t
        r.req.stats.propose_s += dt
        if clock is not None:
            clock.propose += dt
        if prop is None:
            return None, dt
        # seconds per drafted token, per method, without catching up on unseen tokens (priced apart: catchup_s)
        self.estimates.observe_propose(r.req.stats.method, max(0.0, dt - prop.catchup_s) / prop.k)
        return prop, dt

    def _forward(self, ids: torch.Tensor, cache, feats: bool, **kw):
        """The target's logits, or (with feats, for proposers reading the target's features) a Scored with the
        last hidden state too, of every position even where last_only keeps the logits of the last one (a
        prefill feeds every feature to the head; the [T, V] logits it would not read cost more than a layer of
        the embedded target)."""
        if feats:
            return self.model.forward_hidden(ids, cache, hidden_all=True, **kw)
        return self.model(ids, cache, **kw)


GRAMMAR_ERROR = "grammar error: "      # how a request whose own grammar failed ends (the server answers it as a 400)


def engine_error(e: BaseException) -> str:
    """The error a request ends with when the engine failed it: the exception's type and first line (a C++
    exception through pybind11 carries the C++ backtrace on the lines after); its grammar's failure is told
    apart (GRAMMAR_ERROR)."""
    from ..structured.state import GrammarError

    text = str(e).strip().splitlines()
    first = text[0][:500] if text else "no message"
    if isinstance(e, GrammarError):
        return GRAMMAR_ERROR + first
    return f"engine error: {type(e).__name__}: {first}"


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """logits [L, V] at prompt positions 0..L-1 -> the target's logprob of targets[j] (the token at j + 1)."""
    lp = torch.log_softmax(logits.float(), -1)                                 # [L, V]
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).view(-1, 1)).view(-1).tolist()
    tops = [[] for _ in targets]
    if top:
        vals, idx = lp.topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(targets, chosen, tops)]

"""The one batched step: propose, score, verify, commit over the rows of a batch.

Every caller goes through `Batch.step`: Engine.generate and Engine.stream (a batch of one), `leaplm generate -n N`,
`leaplm bench` and the server's scheduler (a batch of up to max_batch rows, which requests join and leave between
steps). A step over the n running rows:

  1. propose  each row's own proposer drafts k_i = min(K, its cap, its room) tokens; K is chosen per step by the
              one K policy (adaptive.BatchAdaptiveK) from measured costs and each row's measured acceptance.
              Proposers that share a group (the draft model) draft for all their rows in one call, one batched
              draft forward per draft position; the others row by row. Cheap proposers (n-gram, suffix) propose
              at their row's cap before K is chosen, so the policy knows what they have; then trimmed to K
  2. score    ONE target forward over [n, 1 + max k_i] for the chain rows: row i is [its last token, its drafts,
              padding]; a tree row (Proposal.parents set) is scored by its own forward with the tree mask over a
              batch-1 view of its cache row (when every row is a tree row the batched forward is skipped)
  3. verify   per row, the pure verifiers on that row's logits
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

Costs and acceptance are the engine's (adaptive.Estimates): one calibration, shared by every batch of an engine.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from ..config import SamplingParams
from ..propose.base import Proposal, ProposeContext, Proposer
from ..sampling import LogitsProcessor
from .adaptive import (AcceptanceEstimate, BatchAdaptiveK, Estimates, RowSpec, expected_tokens, rows_bucket,
                       with_proposal)
from .commit import commit, finish_chunk, new_request, verify_chain
from .request import Request, StreamChunk, TokenLogprob
from .tree_step import extra_logits, tree_block, verify_tree

log = logging.getLogger(__name__)

MIN_CHUNK = 32     # prompt tokens a step prefills at least, however many the decoding rows take of the budget
PAD_SLACK = 64     # cache slots (and positions) past max_len for the padding of a row near its end: the largest K


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
class Row:
    """One running request: the batch's state for it."""
    req: Request
    proc: LogitsProcessor
    proposer: Proposer | None
    cap: int                                         # this request's own K (0: no speculation)
    fixed_k: bool = False                            # draft cap tokens every step (the request asked adaptive_k off)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    extra_tokens: float = 0.0                        # EMA of tokens a proposal adds beyond its K (lookahead)
    tag: object = None                               # the caller's handle (the scheduler's SeqRequest)
    prefilled: int = 0                               # prompt tokens in the cache (all but the last: prefill done)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.req.prompt_ids) - 1


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


class Batch:
    """Rows of one target KV cache stepped together. engine: a leaplm Engine (target, draft, tokenizer, spec,
    max_model_len, proposer factories, estimates)."""

    def __init__(self, engine, max_rows: int = 1):
        self.engine = engine
        self.model = engine.model
        self.max_rows = max_rows
        self.max_len = engine.max_model_len
        # slots past max_len for padding (positions too, where the model has them): see the step's K
        self.cache = self.model.new_cache(max_rows, min(self.max_len + PAD_SLACK, self.model.max_len))
        self.estimates: Estimates = engine.estimates
        self.policy = BatchAdaptiveK(self.estimates.costs, enabled=engine.spec.adaptive_k)
        self.rows: list[Row] = []                        # row i of the cache <-> rows[i]
        self.decoding = 0                                # rows [0, decoding) decode, the rest still prefill
        self.max_num_batched_tokens: int | None = getattr(engine, "max_num_batched_tokens", None)
        full_step = max_rows * (1 + engine.spec.k) + MIN_CHUNK
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < full_step:
            # every running row decodes each step; prompts get only what is left (at least MIN_CHUNK), so a full
            # batch admits new requests a few prompt tokens per step (measured: minute-long TTFTs at 64 rows / 96)
            log.warning("max_num_batched_tokens=%d is below what %d decoding rows with K=%d take plus a chunk (%d): "
                        "a full batch prefills new prompts %d tokens per step", self.max_num_batched_tokens,
                        max_rows, engine.spec.k, full_step, MIN_CHUNK)
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
        eng = self.engine
        method = method or eng.spec.method
        factory = eng.proposer_factory(method)
        cap = (k if k is not None else eng.spec.k) if factory is not None else 0
        req = new_request(ids, params, tokenizer=eng.tokenizer, eos_token_ids=eng.target.eos_token_ids,
                          vocab_size=self.model.vocab_size, device=self.model.device, method=method, k=cap)
        i = len(self.rows)
        self.cache.truncate(0, i)
        t0 = time.perf_counter()
        prompt_lps = None
        # prefilled at once unless a budget chunks it; prompt logprobs come back with the join, so whole too
        whole = self.max_num_batched_tokens is None or prompt_logprobs is not None
        proposer = self._new_proposer(method, factory) if factory is not None else None
        try:
            if len(ids) > 1 and whole:
                want = prompt_logprobs is not None
                feats = reads_hidden(proposer)
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
            close = getattr(proposer, "close", None)
            if close is not None:
                close()
            raise
        req.stats.prefill_s = time.perf_counter() - t0
        seen = self.estimates.method_acceptance.get(method)
        acceptance = AcceptanceEstimate.seeded(seen) if seen is not None else AcceptanceEstimate()
        row = Row(req, LogitsProcessor(params), proposer, cap, adaptive_k is False, acceptance, tag=tag,
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
        close = getattr(row.proposer, "close", None)
        if close is not None:                            # a grouped proposer frees its row of the group
            close()
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
        ts = time.perf_counter()
        failed = self._prefill()
        rows = self.rows[: self.decoding]
        n = len(rows)
        if not n:
            return StepOutcome(failed, None, time.perf_counter())
        td = time.perf_counter()                 # decoding starts (the policy measures steps from here)

        # 1. propose: one K for the step, each row drafts up to min(K, its own cap). A sampled row's tokens are
        # fixed by its seed and their positions (sampling/positional.py): K never changes what a seed produces.
        # Cheap proposers (n-gram, suffix) propose first, at their row's cap: the policy then knows which rows
        # have a proposal, how long, and of what match length (adaptive.with_proposal).
        drafting = self._drafting_rows(rows)
        specs = [self._row_spec(r, drafting) for r in rows]
        early, early_s = self._propose_early(rows, specs)
        chosen = self.policy.choose([sp for sp, r in zip(specs, rows) if not r.fixed_k])
        K = max([chosen] + [sp.cap for sp, r in zip(specs, rows) if r.fixed_k])   # a fixed-K row drafts its K
        # Every row gets 1 + K slots written, padding included: K must fit the fullest row's cache. Each row's
        # drafts are capped by its own room (its spec), so with PAD_SLACK slots past max_len a row near its end
        # caps only itself; only where the model has no positions left for the padding does it cap the step.
        K = min(K, self.cache.max_len - 1 - max(len(r.req.tokens) - 1 for r in rows))
        asked = [min(K, spec.cap) for spec in specs]
        proposals, propose_s = self._propose_all([0 if i in early else k for i, k in enumerate(asked)])
        for i, p in early.items():
            proposals[i] = self._trim(p, asked[i]) if p is not None and asked[i] else None
        propose_s += early_s
        self.policy.probed(any(p is not None for p in proposals))
        tp = time.perf_counter()

        # 2. score: one forward over [n, T] for the chains; a tree row's block there is its last token alone
        chain = [p if p is not None and p.parents is None else None for p in proposals]
        T = 1 + max((p.k for p in chain if p is not None), default=0)
        logits = None
        if any(p is None or p.parents is None for p in proposals):
            block = torch.zeros(n, T, dtype=torch.long)                                  # [n, T]
            for i, (r, p) in enumerate(zip(rows, chain)):
                block[i, 0] = r.req.tokens[-1]
                if p is not None:
                    block[i, 1: 1 + p.k] = p.tokens.to("cpu")
            feats = any(reads_hidden(r.proposer) for r in rows)
            # a model taking ragged rows (libllama) skips the padding, and a tree row's block (scored below)
            ragged = {"row_tokens": [0 if p is not None and p.parents is not None else 1 + (c.k if c is not None else 0)
                                     for p, c in zip(proposals, chain)]} if getattr(self.model, "ragged", False) else {}
            out = self._forward(block.to(self.model.device), self.cache, feats, **ragged)
            logits, hidden = (out.logits, out.hidden) if feats else (out, None)       # [n, T, V], [n, T, hid]
            self.estimates.costs.observe(n, T, time.perf_counter() - tp)
        tv = time.perf_counter()

        # 3. verify + 4. commit, row by row (tree rows: scored and verified here, one forward each)
        drafted, accepted, emitted, outputs = [], [], [], []
        tree_score_s = verify_s = commit_s = 0.0
        for i, (r, p) in enumerate(zip(rows, proposals)):
            d = p.k if p is not None else 0
            out = RowOutput(r)
            t0 = time.perf_counter()
            row_score_s = 0.0
            try:
                if p is not None and p.parents is not None:
                    result, row_logits, row_hidden, row_score_s = self._score_verify_tree(i, r, p)  # [T_tree, V]
                    rows_kept = [0] + [j + 1 for j in result.path]
                else:
                    row_logits = logits[i, : 1 + d]                                   # [1 + k_i, V]
                    result = verify_chain(r.req, p, r.proc, row_logits)
                    row_hidden, rows_kept = (hidden[i] if hidden is not None else None), None
                t1 = time.perf_counter()
                if reads_hidden(r.proposer):    # the target's features of the committed block tokens
                    kept = rows_kept or list(range(1 + result.accepted))
                    r.proposer.observe_hidden(len(r.req.tokens) - 1, row_hidden[kept])
                if p is not None:
                    r.proposer.observe(p, result, extra_logits(p, row_logits))
                    self._observe_acceptance(r, d, result.accepted, row_logits.shape[0], asked[i],
                                             p.match, known=i in early)
                elif asked[i] and p is None:                 # asked, but the proposer found nothing to draft
                    self._observe_acceptance(r, 0, 0, 1, asked[i])
                out.chunk = commit(r.req, result, row_logits, d, self.cache, row=i)
                t2 = time.perf_counter()
                st = r.req.stats
                st.score_s += row_score_s
                st.verify_s += t1 - t0 - row_score_s
                st.commit_s += t2 - t1
                tree_score_s += row_score_s
                verify_s += t1 - t0 - row_score_s
                commit_s += t2 - t1
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                log.exception("a request failed in a step")
                out.error = f"engine error: {type(e).__name__}: {e}"
                d, result = 0, None
            drafted.append(d)
            accepted.append(result.accepted if result is not None else 0)
            emitted.append(len(out.chunk.token_ids) if out.chunk is not None else 0)
            outputs.append(out)
        te = time.perf_counter()
        for r in rows:
            r.req.stats.score_s += tv - tp
            r.req.stats.decode_s += te - ts
        self.current_k = K
        self.steps += 1
        # the step's time without its commits (paid per token, drafted or not: they do not make drafting dearer)
        self.policy.observe_step(n, sum(drafted), te - td - commit_s, n + sum(accepted), chosen=K == chosen,
                                 catchup_s=sum(p.catchup_s for p in proposals if p is not None))
        for i in reversed(range(n)):
            out = outputs[i]
            if out.chunk is not None:
                finish_chunk(out.row.req, out.chunk)
            if out.finished:
                self.remove(i)
        report = StepReport(n, K, T, drafted, accepted, emitted, propose_s, tv - tp + tree_score_s, verify_s, commit_s,
                            te - ts)
        return StepOutcome(failed + outputs, report, te)

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
                    feats = reads_hidden(r.proposer)
                    out = self._forward(torch.tensor([ids[r.prefilled: r.prefilled + n]], device=self.model.device),
                                        self._row_cache(i), feats, last_only=True)
                    if feats:
                        r.proposer.observe_hidden(r.prefilled, out.hidden[0])
                except Exception as e:  # noqa: BLE001 - one request's failure is its own
                    log.exception("a request failed in its prefill")
                    failed.append(RowOutput(self.remove(i), error=f"engine error: {type(e).__name__}: {e}"))
                    continue
                self.cache.advance(n, i)
                r.prefilled += n
                r.req.stats.prefill_s += time.perf_counter() - t0
            if not r.prefilling:
                self.decoding += 1
        return failed

    @staticmethod
    def _drafting_rows(rows: list[Row]) -> dict[str, int]:
        """method -> rows that would draft together in this step (a group's cost per token depends on it)."""
        out: dict[str, int] = {}
        for r in rows:
            if r.proposer is not None and getattr(r.proposer, "group", None) is not None:
                out[r.req.stats.method] = out.get(r.req.stats.method, 0) + 1
        return out

    def _row_spec(self, r: Row, drafting: dict[str, int] | None = None) -> RowSpec:
        # Under the adaptive policy a row's first step drafts nothing: its first token then costs one target
        # forward, not the draft's catching up with the prompt as well (time to first token). A fixed K drafts
        # from the first step.
        room = max(0, self.max_len - len(r.req.tokens) - 1)
        first = r.req.stats.target_forwards == 0 and self.policy.enabled and not r.fixed_k
        cap = max(0, min(r.cap, room, r.req.remaining - 1)) if r.proposer is not None and not first else 0
        method = r.req.stats.method
        return RowSpec(cap, r.acceptance.rate, self.estimates.propose_cost(method, (drafting or {}).get(method, 1)),
                       self.catchup_s(r), extra_tokens=r.extra_tokens, tokens_by_k=r.acceptance.tokens_by_k(cap),
                       match=r.acceptance.match, tokens_by_k_after_hit=r.acceptance.tokens_by_k_after_hit(cap))

    def _propose_early(self, rows: list[Row], specs: list[RowSpec]) -> tuple[dict[int, Proposal | None], float]:
        """Rows whose proposer is cheap propose at their cap before K is chosen; their specs (in place) then say
        what they have. Returns row -> its proposal (None: it had nothing), and the seconds it took."""
        early: dict[int, Proposal | None] = {}
        total = 0.0
        for i, (r, sp) in enumerate(zip(rows, specs)):
            if sp.cap <= 0 or not getattr(r.proposer, "cheap", False):
                continue
            p, dt = self._propose(i, r, sp.cap)
            total += dt
            early[i] = p
            r.acceptance.observe_match(p is not None)
            self.estimates.acceptance(r.req.stats.method).observe_match(p is not None)
            specs[i] = with_proposal(sp, r.acceptance, p.k if p is not None else 0,
                                     p.match if p is not None else None)
        return early, total

    def _observe_acceptance(self, r: Row, drafted: int, accepted: int, scored: int, asked: int,
                            match: int | None = None, known: bool = False) -> None:
        """drafted 0: the row was asked for drafts and its proposer had none (counts only towards `match`).
        known: the proposal was made before K was chosen, of context match length `match`."""
        r.acceptance.observe(drafted, accepted, max(asked, drafted), match, known)
        self.estimates.observe_acceptance(r.req.stats.method, drafted, accepted, max(asked, drafted), match, known)
        if not drafted:
            return
        extra = max(0, scored - drafted - 1)
        r.extra_tokens = extra if r.extra_tokens == 0 else 0.9 * r.extra_tokens + 0.1 * extra

    def catchup_s(self, r: Row) -> float:
        """Seconds a draft model needs to prefill what it has not seen (a row that has not drafted yet: its whole
        context), spread over the steps the request has left: near the end of a request it does not pay."""
        lag = getattr(r.proposer, "lag", None)
        per_token = self.estimates.draft_prefill_s_per_token
        if lag is None or not per_token:
            return 0.0
        steps_left = max(1.0, r.req.remaining / expected_tokens(r.acceptance.rate, max(1, r.cap)))
        return lag(len(r.req.tokens)) * per_token / steps_left

    def _row_cache(self, i: int):
        """Row i as a batch-1 cache (the cache itself when it has one row)."""
        return self.cache if self.cache.batch_size == 1 else self.cache.row_view(i)

    def _new_proposer(self, method: str, factory) -> Proposer:
        """A proposer for a joining row; one that can draft for many rows at once shares this batch's group."""
        new_group = getattr(factory, "new_group", None)
        if new_group is None:
            return factory(self.max_len)
        if method not in self.groups:
            self.groups[method] = new_group(self.max_rows, self.max_len)
        return factory(self.max_len, self.groups[method])

    def _context(self, i: int, r: Row, k: int) -> ProposeContext:
        return ProposeContext(r.req.tokens, k, r.req.params, r.proc, r.req.generator, r.req.presence,
                              self._row_cache(i), r.req.seed)

    def _propose_all(self, asked: list[int]) -> tuple[list[Proposal | None], float]:
        """Every row's proposal (None: nothing drafted) of at most asked[i] tokens, and the seconds proposing took.
        Rows whose proposers share a group draft together (one call, batched forwards); the others one by one."""
        proposals: list[Proposal | None] = [None] * len(asked)
        groups: dict[int, list[int]] = {}
        total = 0.0
        for i, (r, k) in enumerate(zip(self.rows, asked)):
            if k <= 0:
                continue
            if getattr(r.proposer, "group", None) is not None:
                groups.setdefault(id(r.proposer.group), []).append(i)
            else:
                proposals[i], dt = self._propose(i, r, k)
                total += dt
        for idx in groups.values():
            t = time.perf_counter()
            group = self.rows[idx[0]].proposer.group
            props = group.propose_rows([self.rows[i].proposer for i in idx],
                                       [self._context(i, self.rows[i], asked[i]) for i in idx])
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
        tree; a tree with extra tokens is kept whole)."""
        if prop.k > k and prop.extra is None:
            parents = prop.parents[:k] if prop.parents is not None else None
            prop = dataclasses.replace(prop, tokens=prop.tokens[:k], q=prop.q[:k] if prop.q is not None else None,
                                       parents=parents)
        return prop if prop.k > 0 else None

    def _propose(self, i: int, r: Row, k: int) -> tuple[Proposal | None, float]:
        """Row i's proposal of at most k tokens (None: nothing drafted) and the seconds it took."""
        if k <= 0:
            return None, 0.0
        t = time.perf_counter()
        prop = self._trim(r.proposer.propose(self._context(i, r, k)), k)
        dt = time.perf_counter() - t
        r.req.stats.propose_s += dt
        if prop is None:
            return None, dt
        # seconds per drafted token, per method, without catching up on unseen tokens (priced apart: catchup_s)
        self.estimates.observe_propose(r.req.stats.method, max(0.0, dt - prop.catchup_s) / prop.k)
        return prop, dt

    def _score_verify_tree(self, i: int, r: Row, p: Proposal):
        """A tree proposal of row i: its own forward with the tree mask (after the batched one, whose slots for this
        row it overwrites), then the tree verifier. Returns (result, logits [T_tree, V], hidden or None, forward seconds)."""
        tb = tree_block(r.req, p)
        t = time.perf_counter()
        feats = reads_hidden(r.proposer)
        out = self._forward(tb.ids.unsqueeze(0), self._row_cache(i), feats, tree_mask=tb.layout.mask,
                            position_offsets=tb.layout.depths)
        logits, hidden = (out.logits[0], out.hidden[0]) if feats else (out[0], None)   # [T_tree, V | hid]
        dt = time.perf_counter() - t
        self.estimates.costs.observe(1, tb.ids.numel(), dt)
        return verify_tree(r.req, p, r.proc, logits, tb.layout), logits, hidden, dt

    def _forward(self, ids: torch.Tensor, cache, feats: bool, **kw):
        """The target's logits, or (with feats, for proposers reading the target's features) a Scored with the
        last hidden state too, of every position even where last_only keeps the logits of the last one (a
        prefill feeds every feature to the head; the [T, V] logits it would not read cost more than a layer of
        the embedded target)."""
        if feats:
            return self.model.forward_hidden(ids, cache, hidden_all=True, **kw)
        return self.model(ids, cache, **kw)


def reads_hidden(proposer) -> bool:
    """Proposers reading the target's features (EAGLE) get them through observe_hidden(start, hidden)."""
    return getattr(proposer, "reads_hidden", False)


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """logits [L, V] at prompt positions 0..L-1 -> the target's logprob of targets[j] (the token at j + 1)."""
    lp = torch.log_softmax(logits.float(), -1)                                 # [L, V]
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).view(-1, 1)).view(-1).tolist()
    tops = [[] for _ in targets]
    if top:
        vals, idx = lp.topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(targets, chosen, tops)]


def calibrate(engine, max_rows: int = 1, ctx: int = 256, repeats: int = 2) -> None:
    """The one cost calibration: batched forward costs at n in 1, 2, 4, ... max_rows rows and T = 1 .. K + 1
    tokens (live steps keep refreshing them), a draft model's prefill cost per token and its one-token forward
    (the prior of the draft's cost per drafted token). Sizes already measured on this engine are skipped."""
    est: Estimates = engine.estimates
    model = engine.model
    ctx = max(1, min(ctx, engine.max_model_len // 2))
    k = engine.spec.k
    ns = sorted({min(max_rows, 1 << i) for i in range(max_rows.bit_length() + 1)} - est.calibrated_rows)
    dev = model.device
    if ns:
        cache = model.new_cache(max(ns), engine.max_model_len)
        Ts = list(range(1, min(k + 1, engine.max_model_len - ctx) + 1))
        for n in ns:
            cache.lengths[:n] = [ctx] * n
            forward = lambda T: model(torch.zeros(n, T, dtype=torch.long, device=dev), cache)  # noqa: E731
            forward(Ts[-1])                              # warm-up: the first forward of a shape is not its cost
            # rounds of every T back to back, the order reversed every other round (a trend in the machine's
            # speed within a round cancels); the cost model keeps their paired ratios (shape) and level
            rounds = [{T: _timed(lambda: forward(T)) for T in (Ts if j % 2 == 0 else Ts[::-1])}
                      for j in range(max(2, repeats))]
            est.costs.calibrated(n, rounds)
            cache.lengths[:n] = [0] * n
        est.calibrated_rows.update(ns)
    if engine.draft is not None and not est.draft_prefill_s_per_token:
        draft = engine.draft.model
        n_tok = max(1, min(ctx, draft.max_len - 2))
        cache = draft.new_cache(1, n_tok + 1)
        best = one = float("inf")
        for _ in range(repeats + 1):
            cache.lengths[0] = 0
            t = time.perf_counter()
            draft(torch.zeros(1, n_tok, dtype=torch.long, device=draft.device), cache, last_only=True)
            best = min(best, time.perf_counter() - t)
            cache.lengths[0] = n_tok
            t = time.perf_counter()
            draft(torch.zeros(1, 1, dtype=torch.long, device=draft.device), cache, last_only=True)
            one = min(one, time.perf_counter() - t)
        est.draft_prefill_s_per_token = best / n_tok
        est.propose_s.setdefault("draft", one)
    if engine.draft is not None:
        # the draft's one-token forward over n rows at once (a batch's draft rows draft together): per drafted token
        draft = engine.draft.model
        n_ctx = max(1, min(ctx, draft.max_len - 2))
        todo = [n for n in sorted({min(max_rows, 1 << i) for i in range(max_rows.bit_length() + 1)})
                if ("draft", rows_bucket(n)) not in est.propose_s_rows]
        if todo and (max(todo) == 1 or getattr(draft, "supports_batch", False)):
            cache = draft.new_cache(max(todo), n_ctx + 1)
            for n in todo:
                cache.lengths[:n] = [n_ctx] * n
                best = min(_timed(lambda: draft(torch.zeros(n, 1, dtype=torch.long, device=draft.device), cache,
                                                last_only=True)) for _ in range(repeats + 1))
                est.propose_s_rows[("draft", rows_bucket(n))] = best / n


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t

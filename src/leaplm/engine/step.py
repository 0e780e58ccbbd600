"""The one batched step: propose, score, verify, commit over the rows of a batch.

Every caller goes through `Batch.step`: Engine.generate and Engine.stream (a batch of one), `leaplm generate -n N`
(N rows), `leaplm bench` and the server's scheduler (a batch of up to max_batch rows, which requests join and
leave between steps). A step over the n decoding rows:

  0. prefill  the rows still prefilling get what the decoding rows leave of the token budget (engine/table.py:
              the row table, which also joins and removes rows and keeps their cache rows dense)
  1. propose  the K policy (engine/kpolicy/policy.py) plans the step: one K, each row drafting k_i = min(K, its cap, its
              room), a method measured to lose in a mixed batch at 0 (engine/batch_k.py); the proposers draft
              (engine/proposing.py); a constrained row whose grammar forces the next
              tokens drafts them instead, for free, and every constrained row's drafts are cut to its grammar
              (engine/constrain.py)
  2. score    ONE target forward over [n, 1 + max k_i] for the chain rows (engine/scoring.py); a tree row is
              scored by its own forward in stage 3 (engine/tree_step.py)
  3. verify   per row, the verifier its request runs (engine/verification.py) on that row's logits, a
              constrained row's masked by its grammar first
  4. commit   per row (engine/commit.py): tokens, stop ids and strings, max_new_tokens, logprobs, stats, and the
              row's cache length. Only commit changes state.

The stages report their timings and outcomes to the K policy through one interface (engine/observer.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from ..config import SamplingParams, SpecConfig, StructuredOutput
from ..propose.base import Proposal, Proposer, ProposerFactory
from ..propose.prediction import with_prediction
from ..sampling import LogitsProcessor
from .batch_k import BatchK
from .commit import finish_chunk, new_request, verify_commit
from .constrain import GrammarWork, dead_end, forced_proposals
from .kpolicy.estimates import Estimates
from .kpolicy.policy import KPolicy
from .kpolicy.priors import acceptance_band
from .proposing import planned, propose_row, propose_rows
from .request import TokenLogprob
from .row import Row, RowOutput
from .scoring import score_chains
from .stats import StepClock
from .table import MIN_CHUNK, RowTable

log = logging.getLogger(__name__)


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
    deferred: int = 0               # rows that sat the step out, waiting for their grammar's masks


@dataclass
class StepOutcome:
    outputs: list[RowOutput]         # one per row that ran, finished rows already removed from the batch
    report: StepReport | None        # None when no row decoded (the step only prefilled)
    time: float                      # perf_counter at the end of the step


class Batch:
    """Rows of one target KV cache stepped together (see the module docstring)."""

    def __init__(self, engine: StepHost, max_rows: int = 1):
        self.model = engine.model
        self.tokenizer = engine.tokenizer
        self.eos_token_ids = engine.target.eos_token_ids
        self.spec = engine.spec
        self.proposer_factory = engine.proposer_factory
        self.grammar_state = engine.grammar_state
        self.max_len = engine.max_model_len
        self.table = RowTable(self.model, max_rows, self.max_len, engine.max_num_batched_tokens)
        self.policy = KPolicy(engine.estimates, enabled=self.spec.adaptive_k, max_len=self.max_len)
        self.batch_k = BatchK(engine.estimates, enabled=self.spec.adaptive_k)     # which methods of a mixed batch draft
        budget, full_step = engine.max_num_batched_tokens, max_rows * (1 + self.spec.k) + MIN_CHUNK
        if budget is not None and budget < full_step:
            # every running row decodes each step; prompts get only what is left (at least MIN_CHUNK), so a full
            # batch admits new requests a few prompt tokens per step (measured: minute-long TTFTs at 64 rows / 96)
            log.warning("max_num_batched_tokens=%d is below what %d decoding rows with K=%d take plus a chunk (%d): "
                        "a full batch prefills new prompts %d tokens per step", budget, max_rows, self.spec.k,
                        full_step, MIN_CHUNK)
        self.groups: dict[str, object] = {}              # method -> ProposerGroup of rows that draft together
        self.grammar = GrammarWork(max_rows)             # constrained rows' masks, beside the step's thread
        self.current_k = 0
        self.steps = 0

    @property
    def rows(self) -> list[Row]:
        return self.table.rows

    @property
    def cache(self):
        return self.table.cache

    @property
    def full(self) -> bool:
        return self.table.full

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
        t0 = time.perf_counter()
        # prefilled at once unless a budget chunks it; prompt logprobs come back with the join, so whole too
        whole = self.table.max_num_batched_tokens is None or prompt_logprobs is not None
        proposer = self._new_proposer(method, factory) if factory is not None else None
        if params.prediction is not None:        # drafted ahead of the method's proposer (propose/prediction.py)
            proposer, cap = with_prediction(proposer, cap, params.prediction, self.tokenizer, len(ids), req.tokens,
                                            self.model.device, self.groups)
            req.stats.k = cap
        try:
            logits = self.table.prefill_joining(ids, proposer, whole, logits_of_prompt=prompt_logprobs is not None)
        except Exception:
            if proposer is not None:
                proposer.close()
            raise
        prompt_lps = None
        if prompt_logprobs is not None:
            prompt_lps = [None] + (prompt_token_logprobs(logits, ids[1:], prompt_logprobs) if logits is not None
                                   else [])
        req.stats.prefill_s = time.perf_counter() - t0
        band = acceptance_band(params.temperature, params.structured is not None)
        row = Row(req, LogitsProcessor(params), proposer, cap, adaptive_k is False,
                  self.policy.new_acceptance(method, proposer is not None and proposer.bursty, band,
                                             predicted=params.prediction is not None), tag=tag,
                  prefilled=len(ids) - 1 if whole else 0, band=band)
        self.table.add(row)
        return row, prompt_lps

    def remove(self, i: int) -> Row:
        """Remove row i (its proposer freed, the other rows kept dense: RowTable.remove)."""
        return self.table.remove(i)

    def step(self) -> StepOutcome | None:
        """One step over every row; rows that finished or failed are removed. None when no row runs."""
        if not self.rows:
            return None
        clock = StepClock()
        failed = self.table.prefill(self.table.decoding * (1 + self.current_k))
        rows = self.rows[: self.table.decoding]
        n = len(rows)
        if not n:
            return StepOutcome(failed, None, time.perf_counter())
        clock.decoding()                         # the policy measures steps from here

        # 1. propose: the plan's K (cheap proposers asked inside it), the others now, the grammar's cuts after
        room = self.table.room(rows)
        busy = frozenset(i for i, r in enumerate(rows) if r.pending is not None)   # proposed in an earlier step
        forced = {}
        if self.spec.forced_tokens and any(r.req.grammar is not None for r in rows):
            forced = forced_proposals(rows, room, self.max_len, self.model.device, skip=busy)
        plain = self.batch_k.plain_rows(rows)            # a mixed batch's methods measured to lose here
        plan = self.batch_k.plan(rows, self.policy.plan(rows, lambda i, cap: self._propose(i, rows[i], cap, clock)[0],
                                                        room, free=frozenset(forced) | busy | plain))
        errors: dict[int, str] = {}                      # rows whose proposer, grammar or forward failed: they end
        proposals, seconds = planned(plan, rows, self.table.row_cache, self.policy, errors)
        clock.propose += seconds
        # rows whose masks are not ready in time sit the step out (deferred)
        proposals, constraints, deferred = self.grammar.constrain(rows, proposals, forced, errors, room)

        # 2. score: one forward over [n, T] for the chains; a tree row's block there is its last token alone
        scored = score_chains(self.model, self.cache, rows, proposals, errors, self.table.row_cache, deferred)
        if scored.seconds is not None:
            clock.batched_score(scored.seconds)
            if not scored.alone:                         # rows scored one by one: not the cost of [n, T]
                self.policy.observe_forward(n, scored.T, scored.seconds)
                self.grammar.observe_forward(scored.seconds)

        # 3. verify + 4. commit, row by row (tree rows: scored and verified here, one forward each)
        outputs, done = [], []
        for i, (r, p) in enumerate(zip(rows, proposals)):
            rc = constraints.get(i)
            end = dead_end(r.req, rc) if rc is not None else None       # the grammar admits no token: it ends
            if i in errors:
                out, d = RowOutput(r, error=errors[i]), None
            elif i in deferred:
                out, d = RowOutput(r), None
            elif end is not None:
                out, d = RowOutput(r, end), None
            else:
                out, d = verify_commit(self.model, self.cache, i, r, p, scored, clock, self.policy, rc)
            outputs.append(out)
            done.append(d)
        clock.end(rows)
        self.current_k = plan.k
        self.steps += 1
        self.policy.observe(rows, plan, done, timed=not (forced or busy or deferred),
                            wall=clock.stop - clock.decode_start)
        self.batch_k.observe(rows, plan, done, clock.stop - clock.decode_start, not (forced or busy or deferred))
        for i in reversed(range(n)):
            out = outputs[i]
            if out.chunk is not None:
                finish_chunk(out.row.req, out.chunk)
            if out.finished:
                self.remove(i)
        report = StepReport(n, plan.k, scored.T, [d.drafted if d else 0 for d in done],
                            [d.accepted if d else 0 for d in done],
                            [len(o.chunk.token_ids) if o.chunk is not None else 0 for o in outputs],
                            clock.propose, clock.score, clock.verify, clock.commit, clock.total, len(deferred))
        return StepOutcome(failed + outputs, report, clock.stop)

    def catchup_s(self, r: Row) -> float:
        """The K policy's price of row r's draft model catching up (kpolicy.policy.KPolicy.catchup_s)."""
        return self.policy.catchup_s(r)

    def _new_proposer(self, method: str, factory: ProposerFactory) -> Proposer:
        """A proposer for a joining row; one that can draft for many rows at once shares this batch's group."""
        if method not in self.groups:
            self.groups[method] = factory.new_group(self.table.max_rows, self.max_len)
        return factory(self.max_len, self.groups[method])

    def _propose(self, i: int, r: Row, k: int, clock: StepClock | None = None) -> tuple[Proposal | None, float]:
        """Row i's proposal of at most k tokens (None: nothing drafted) and the seconds it took."""
        prop, dt = propose_row(r, k, partial(self.table.row_cache, i), self.policy)
        if clock is not None:
            clock.propose += dt
        return prop, dt

    def _propose_all(self, asked: list[int], failed: dict[int, str] | None = None
                     ) -> tuple[list[Proposal | None], float]:
        """Every decoding row's proposal of at most asked[i] tokens (proposing.propose_rows)."""
        return propose_rows(self.rows, asked, self.table.row_cache, self.policy, failed)


def prompt_token_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """logits [L, V] at prompt positions 0..L-1 -> the target's logprob of targets[j] (the token at j + 1)."""
    lp = torch.log_softmax(logits.float(), -1)                                 # [L, V]
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).view(-1, 1)).view(-1).tolist()
    tops = [[] for _ in targets]
    if top:
        vals, idx = lp.topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(targets, chosen, tops)]

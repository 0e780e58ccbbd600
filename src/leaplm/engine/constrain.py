"""Structured output in the step: a constrained row's drafts, masks and forced tokens (structured/state.py).

For a row whose request carries a grammar state, the step:
  before proposing   asks for the tokens the grammar forces next; when there are some they are the row's proposal
                     (deterministic drafts, q = None) and its proposer is not asked this step: forced tokens cost
                     nothing to propose, so they stay outside the K policy (the step is not timed as drafting)
  after proposing    cuts a chain at its first token the grammar forbids, prunes a tree's forbidden branches (a
                     sampled proposal, q given, keeps that token as its last or as a leaf: rejection sampling rejects
                     it for sure and samples the residual there, as it would have without the cut; cutting a sampled
                     token away instead would bias what rejection sampling emits), and keeps the mask [T, V] of
                     every verified position (row j: after the block's first j drafts)
  verifying          masks the target's logits with it: forbidden tokens at -inf, so greedy's argmax, the race and
                     rejection sampling all see the masked p, the constrained target's distribution at that position
  committing         advances the grammar state by the tokens kept (commit.commit): state and cache move together;
                     the grammar's completion ends the request like a stop token (nothing after it is output)

A committed state whose mask is empty is a dead end: the request ends with finish_reason "constraint" (or "stop"
when the grammar is complete and the tokenizer has no end-of-sequence token to say so).

The cut and the masks are computed in grammar workers beside the step's thread (GrammarWork): a row whose masks
take longer than about one batched forward sits the step out, so a costly grammar delays only its own request.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..propose.base import Proposal
from ..structured.state import GrammarState
from .request import Request, StreamChunk
from .row import Row, engine_error

log = logging.getLogger(__name__)

MAX_FORCED = 16          # forced tokens drafted per step at most (they lengthen every row's block in a batch)


@dataclass
class RowConstraint:
    """What the step keeps for one constrained row between proposing and verifying."""
    masks: torch.Tensor              # [1 + k, V] bool: allowed tokens at each verified position (chain or tree)
    forced: bool = False             # the proposal is the grammar's forced tokens (the proposer was not asked)


def forced_proposal(req: Request, limit: int, device) -> Proposal | None:
    """The grammar's forced tokens from the committed state as a deterministic proposal (None: none forced)."""
    state: GrammarState = req.grammar
    t = time.perf_counter()
    toks = state.forced(min(limit, MAX_FORCED))
    req.stats.grammar_s += time.perf_counter() - t
    return Proposal(torch.tensor(toks, dtype=torch.long, device=device)) if toks else None


def forced_proposals(rows: list[Row], fit: int, max_len: int, device, skip: frozenset[int] = frozenset()
                     ) -> dict[int, Proposal]:
    """Constrained rows whose grammar forces the next tokens -> those tokens as the row's proposal (within fit, the
    cache's room for every row, the row's own room and its remaining tokens). skip: rows whose grammar state a
    worker holds (GrammarWork)."""
    out = {}
    for i, r in enumerate(rows):
        if i in skip:
            continue
        limit = min(fit, max_len - len(r.req.tokens) - 1, r.req.remaining - 1)
        try:
            p = forced_proposal(r.req, limit, device) if r.req.grammar is not None and limit > 0 else None
        except Exception:  # noqa: BLE001 - the row's grammar fails again where it is constrained, and ends there
            p = None
        if p is not None:
            out[i] = p
    return out


class GrammarWork:
    """Constrained rows' grammar work (constrain_proposal: the cut and the masks along the drafts) in worker
    threads beside the step's thread, one per row at most. llguidance computes masks without the GIL, so rows'
    masks are computed side by side and beside the step's Python.

    The step waits for the work it starts at most about as long as its batched forward takes (the average of recent
    forwards, at least MIN_WAIT_S). A row whose work is not done by then sits the step out: nothing is scored or
    committed for it, and Row.pending keeps the work; the first step after the work is done runs the row with that
    proposal and its masks (the row's tokens, cache and proposer have not moved meanwhile, so they are the
    proposal and masks of that state). A grammar whose masks are costly (tens of milliseconds a mask: a hostile
    regex) then delays the other rows' steps by at most about one forward, once, instead of by all its masks at
    every step. When no other row could step, the step waits for the first work to finish."""

    MIN_WAIT_S = 0.002

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.forward_s = 0.0                     # average seconds of recent batched forwards
        self._pool: ThreadPoolExecutor | None = None

    @property
    def wait_s(self) -> float:
        return max(self.MIN_WAIT_S, self.forward_s)

    def observe_forward(self, seconds: float) -> None:
        self.forward_s = seconds if self.forward_s == 0 else 0.8 * self.forward_s + 0.2 * seconds

    def constrain(self, rows: list[Row], proposals: list[Proposal | None], forced: dict[int, Proposal],
                  failed: dict[int, str], room: int
                  ) -> tuple[list[Proposal | None], dict[int, RowConstraint], frozenset[int]]:
        """The forced rows' proposals put in; every constrained row's work started (unless a worker has it from an
        earlier step) and waited for as the class docstring says. Returns the proposals, the masks of the rows
        whose work is done (a proposal from an earlier step cut to `room`, what the cache has slots for now), and
        the rows that sit this step out (their proposal None). A row whose grammar fails is put in `failed`."""
        proposals = [forced.get(i, p) for i, p in enumerate(proposals)]
        fresh = []
        for i, r in enumerate(rows):
            if r.req.grammar is not None and i not in failed and r.pending is None:
                r.pending = self._submit(r.req, proposals[i], i in forced)
                fresh.append(r.pending)
        busy = [i for i, r in enumerate(rows) if r.pending is not None]
        if not busy:
            return proposals, {}, frozenset()
        if len(busy) + len(set(failed) - set(busy)) == len(rows):       # no other row could step
            wait([rows[i].pending for i in busy], return_when=FIRST_COMPLETED)
        if fresh:
            wait(fresh, timeout=self.wait_s)
        constraints: dict[int, RowConstraint] = {}
        deferred = set()
        for i in busy:
            r = rows[i]
            if not r.pending.done():
                deferred.add(i)
                proposals[i] = None
                continue
            work, r.pending = r.pending, None
            try:
                prop, rc = work.result()
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                log.info("a request's grammar failed: %s", e)
                failed[i] = engine_error(e)
                proposals[i] = None
                continue
            proposals[i], constraints[i] = _fit(prop, rc, room)
        return proposals, constraints, frozenset(deferred)

    def _submit(self, req: Request, prop: Proposal | None, forced: bool) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_rows, thread_name_prefix="leaplm-grammar-masks")
        return self._pool.submit(constrain_proposal, req, prop, forced)


def _fit(prop: Proposal | None, rc: RowConstraint, room: int) -> tuple[Proposal | None, RowConstraint]:
    """A proposal made in an earlier step within the drafts the cache has slots for now (the rows beside it may
    have grown since): a chain cut to its first `room` tokens, a tree dropped (the root's mask kept)."""
    if prop is None or prop.k <= room:
        return prop, rc
    if prop.parents is None:
        return _cut(prop, room), RowConstraint(rc.masks[: room + 1], rc.forced)
    return None, RowConstraint(rc.masks[:1], rc.forced)


def constrain_proposal(req: Request, prop: Proposal | None, forced: bool = False
                       ) -> tuple[Proposal | None, RowConstraint]:
    """The proposal cut (chain) or pruned (tree) to what the grammar allows, and the masks of its positions."""
    state: GrammarState = req.grammar
    t = time.perf_counter()
    if prop is None:
        out, masks = None, state.allowed().unsqueeze(0)                           # [1, V]
    elif prop.parents is None:
        n, masks = state.plan_chain(prop.tokens.tolist(), keep_forbidden=prop.q is not None)   # [n + 1, V]
        out = _cut(prop, n)
    else:
        plan = state.plan_tree(prop.tokens.tolist(), prop.parents, keep_forbidden=prop.q is not None)
        masks = plan.masks                                                        # [1 + kept, V]
        out = _prune(prop, plan.kept)
    req.stats.grammar_s += time.perf_counter() - t
    return out, RowConstraint(masks.to(prop.tokens.device if prop is not None else "cpu"), forced)


def masked(logits: torch.Tensor, rc: RowConstraint) -> torch.Tensor:
    """logits [T, V] with the first rows (root and drafts; a tree's extra tokens after them are left as they are)
    at -inf where the grammar forbids the token."""
    n = rc.masks.shape[0]
    masks = rc.masks.to(logits.device)
    if n == logits.shape[0]:
        return logits.masked_fill(~masks, float("-inf"))
    return torch.cat([logits[:n].masked_fill(~masks, float("-inf")), logits[n:]])


def dead_end(req: Request, rc: RowConstraint) -> StreamChunk | None:
    """A chunk ending the request when the grammar admits no token at the committed state, else None."""
    if bool(rc.masks[0].any()):
        return None
    req.finish_reason = "stop" if req.grammar.stopped else "constraint"
    return StreamChunk("", [])


def _cut(prop: Proposal, n: int) -> Proposal | None:
    if n >= prop.k:
        return prop
    if n == 0:
        return None
    return Proposal(prop.tokens[:n], prop.q[:n] if prop.q is not None else None, catchup_s=prop.catchup_s,
                    match=prop.match)


def _prune(prop: Proposal, kept: list[int]) -> Proposal | None:
    """The tree's nodes `kept` (closed under parents, in order), parents renumbered; extra tokens kept as they are
    (they see only the committed context, the root and each other)."""
    if len(kept) == prop.k:
        return prop
    if not kept:
        return None
    new = {old: j for j, old in enumerate(kept)}
    idx = torch.tensor(kept, dtype=torch.long, device=prop.tokens.device)
    return Proposal(prop.tokens[idx], prop.q[idx] if prop.q is not None else None,
                    parents=[-1 if prop.parents[o] < 0 else new[prop.parents[o]] for o in kept],
                    extra=prop.extra, catchup_s=prop.catchup_s, match=prop.match)

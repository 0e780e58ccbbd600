"""Stage 1 of the step: propose. Each row drafts k_i = min(K, its cap, its room) tokens, K the step's one
choice (kpolicy.policy.KPolicy.plan). Cheap proposers (n-gram, suffix) propose at their cap inside the plan, so
the policy knows what they have, and are trimmed to K after. Proposers that share a group (the draft model)
draft for all their rows in one call, one batched draft forward per draft position; the others row by row.

A sampled row's tokens are fixed by its seed and their positions (sampling/positional.py): K never changes what a
seed produces. Proposals are cut to the step's K in `trim`, and only there.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Callable

from ..propose.base import Proposal, ProposeContext
from .observer import StepObserver
from .row import Row, engine_error
from .verification import wants_q

if TYPE_CHECKING:
    from .kpolicy.policy import StepPlan

log = logging.getLogger(__name__)


def trim(prop: Proposal, k: int) -> Proposal | None:
    """At most k tokens of prop: a chain's first k, a tree's first k nodes (parents come first, so they are a tree;
    a tree with extra tokens is kept whole). None when nothing is left."""
    if prop.k > k and prop.extra is None:
        parents = prop.parents[:k] if prop.parents is not None else None
        prop = dataclasses.replace(prop, tokens=prop.tokens[:k], q=prop.q[:k] if prop.q is not None else None,
                                   parents=parents)
    return prop if prop.k > 0 else None


def context(r: Row, k: int, cache_of: Callable[[], object]) -> ProposeContext:
    """What row r's proposer reads; cache_of(): the row's batch-1 target cache (RowTable.row_cache), built only for
    a proposer that reads it (a view per row and step is a slice per layer: more than an n-gram lookup costs)."""
    cache = cache_of() if r.proposer.reads_target_cache else None
    return ProposeContext(r.req.tokens, k, r.req.params, r.proc, r.req.generator, r.req.presence, cache, r.req.seed,
                          wants_q(r.req))


def propose_row(r: Row, k: int, cache_of: Callable[[], object], observer: StepObserver
                ) -> tuple[Proposal | None, float]:
    """Row r's proposal of at most k tokens (None: nothing drafted) and the seconds it took."""
    if k <= 0:
        return None, 0.0
    t = time.perf_counter()
    prop = trim(r.proposer.propose(context(r, k, cache_of)), k)
    dt = time.perf_counter() - t
    r.req.stats.propose_s += dt
    if prop is None:
        return None, dt
    # seconds per drafted token, per method, without catching up on unseen tokens (priced apart: catchup_s)
    observer.observe_propose(r.req.stats.method, max(0.0, dt - prop.catchup_s) / prop.k)
    return prop, dt


def propose_rows(rows: list[Row], asked: list[int], row_cache, observer: StepObserver,
                 failed: dict[int, str] | None = None) -> tuple[list[Proposal | None], float]:
    """Every row's proposal (None: nothing drafted) of at most asked[i] tokens, and the seconds proposing took.
    Rows whose proposers share a group draft together (one call, batched forwards); the others one by one.
    A group whose call fails drafts row by row; a row whose proposer fails alone is put in `failed`.
    row_cache(i): row i's batch-1 target cache."""
    failed = {} if failed is None else failed
    proposals: list[Proposal | None] = [None] * len(asked)
    groups: dict[int, list[int]] = {}
    total = 0.0
    for i, (r, k) in enumerate(zip(rows, asked)):
        if k <= 0:
            continue
        if r.proposer.group is not None:
            groups.setdefault(id(r.proposer.group), []).append(i)
        else:
            try:
                proposals[i], dt = propose_row(r, k, partial(row_cache, i), observer)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                log.exception("a request failed proposing")
                failed[i] = engine_error(e)
                continue
            total += dt
    for idx in groups.values():
        t = time.perf_counter()
        group = rows[idx[0]].proposer.group
        try:
            props = group.propose_rows([rows[i].proposer for i in idx],
                                       [context(rows[i], asked[i], partial(row_cache, i)) for i in idx])
        except Exception as e:  # noqa: BLE001 - the rows that cause it end, not the group
            log.warning("drafting for %d rows together failed (%s: %s): drafting row by row", len(idx),
                        type(e).__name__, e)
            props = []
            for i in list(idx):
                try:
                    props.append(group.propose_rows([rows[i].proposer], [context(rows[i], asked[i], partial(row_cache, i))])[0])
                except Exception as e1:  # noqa: BLE001 - one request's failure is its own
                    log.exception("a request failed proposing")
                    failed[i] = engine_error(e1)
            idx = [i for i in idx if i not in failed]
        dt = time.perf_counter() - t
        total += dt
        drafted = sum(p.k for p in props)
        for i, p in zip(idx, props):
            rows[i].req.stats.propose_s += dt * p.k / max(1, drafted)    # the group's time shared by drafted tokens
            proposals[i] = trim(p, asked[i])
        if drafted:
            # per drafted token, without the catching up on unseen tokens (priced apart: catchup_s): counted here,
            # every step after a stretch at K = 0 would price drafting dearer and keep K at 0
            drafting = max(0.0, dt - sum(p.catchup_s for p in props))
            observer.observe_propose(rows[idx[0]].req.stats.method, drafting / drafted, rows=len(idx))
    return proposals, total


def planned(plan: StepPlan, rows: list[Row], row_cache, observer: StepObserver, failed: dict[int, str]
            ) -> tuple[list[Proposal | None], float]:
    """Each row's proposal of at most plan.asked[i] tokens: the rows that proposed in the plan trimmed to it, the
    others asked now (a row whose proposer failed is put in `failed`). Returns them and the seconds proposing
    took."""
    proposals, seconds = propose_rows(rows, [0 if i in plan.early else k for i, k in enumerate(plan.asked)],
                                      row_cache, observer, failed)
    for i, p in plan.early.items():
        proposals[i] = trim(p, plan.asked[i]) if p is not None and plan.asked[i] else None
    return proposals, seconds

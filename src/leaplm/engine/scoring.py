"""Stage 2 of the step: score. ONE target forward over [n, 1 + max k_i] for the chain rows: row i is [its last
token, its drafts, padding]. A tree row (Proposal.parents set) is scored by its own forward with the tree mask over
a batch-1 view of its cache row (engine/tree_step.py); its block here is its last token alone, and when every row
is a tree row the batched forward is skipped.

When nothing reads a step's logits beyond their argmax (every scored row greedy, without a repetition penalty,
logprobs, a grammar or a proposer's extra rows, and no proposer reading the target's features), a model that can
(ModelCapabilities.argmax_head) is asked for each position's argmax alone: its output layer reduces its rows
without writing [n, T, V] logits (a verify block of Gemma 3's 262,144-token vocabulary is T MB of them).

Padding is harmless: a row commits only its accepted + 1 slots, and causal attention means the logits of its real
positions never see the padding after them. A model taking ragged rows (ModelCapabilities.ragged_rows) is told
each row's real length and skips the padding.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..propose.base import Proposal
from .row import Row, engine_error

log = logging.getLogger(__name__)


@dataclass
class ChainScores:
    """The batched forward of a step's chain rows."""
    logits: torch.Tensor | None      # [n, T, V] (None: every row was a tree row, or failed)
    hidden: torch.Tensor | None      # [n, T, hid] when a row's proposer reads the target's features
    T: int                           # 1 + the longest chain draft
    failed: dict[int, str]           # row -> the error that ended it (proposing or scoring)
    seconds: float | None = None     # the forward's time (None: no forward ran)
    alone: bool = False              # the batched forward failed and the rows were scored one by one
    argmax: torch.Tensor | None = None   # [n, T] long: each position's argmax, scored instead of logits when
                                         # nothing read them (reads_logits); logits is then None


def forward(model, ids: torch.Tensor, cache, feats: bool, **kw):
    """The target's logits, or (with feats, for proposers reading the target's features) the model's Scored with
    the last hidden state too, of every position even where last_only keeps the logits of the last one (a prefill
    feeds every feature to the head; the [T, V] logits it would not read cost more than a layer of the embedded
    target)."""
    if feats:
        return model.forward_hidden(ids, cache, hidden_all=True, **kw)
    return model(ids, cache, **kw)


def reads_logits(r: Row, p: Proposal | None) -> bool:
    """Does anything but greedy verification's argmax read row r's logits this step (its chain proposal p)? The
    sampled verifiers, a repetition penalty (presence), logprobs, a grammar's mask and a proposer's extra rows do."""
    req = r.req
    return (req.verifier != "greedy" or req.presence is not None or req.logprobs is not None
            or req.grammar is not None or (p is not None and p.extra is not None))


def score_chains(model, cache, rows: list[Row], proposals: list[Proposal | None], failed: dict[int, str],
                 row_cache, skip: frozenset[int] = frozenset()) -> ChainScores:
    """The one batched target forward over [n, T]: row i is [its last token, its chain's drafts, padding]. Rows in
    `failed` are not scored, nor those in `skip` (rows sitting the step out: their proposal is None; a model
    taking ragged rows is given none of their tokens, another writes their last token past their committed length,
    where a step's padding goes). When the forward fails (a C++ exception, a failed llama_decode), each row is scored
    alone instead (score_alone): the rows that fail alone end with the error, the others go on (their logits do
    not depend on the batch where the backend is batch-invariant, so they commit what the batched forward would
    have given them). row_cache(i): row i's batch-1 cache."""
    t = time.perf_counter()
    chain = [p if p is not None and p.parents is None else None for p in proposals]
    T = 1 + max((p.k for p in chain if p is not None), default=0)
    if all(i in failed or i in skip or (p is not None and p.parents is not None) for i, p in enumerate(proposals)):
        return ChainScores(None, None, T, failed)
    block = torch.zeros(len(rows), T, dtype=torch.long)                              # [n, T]
    for i, (r, p) in enumerate(zip(rows, chain)):
        block[i, 0] = r.req.tokens[-1]
        if p is not None:
            block[i, 1: 1 + p.k] = p.tokens.to("cpu")
    feats = any(r.reads_hidden for r in rows)
    # a model taking ragged rows (libllama) skips the padding, and a tree row's block (scored apart)
    ragged = {}
    if model.capabilities.ragged_rows:
        ragged["row_tokens"] = [0 if i in skip or (p is not None and p.parents is not None)
                                else 1 + (c.k if c is not None else 0) for i, (p, c) in enumerate(zip(proposals, chain))]
    # the argmax alone when no scored row reads its logits (a tree row's block here is not read at all)
    argmax = model.capabilities.argmax_head and not feats and not any(
        reads_logits(r, p) for i, (r, p) in enumerate(zip(rows, chain))
        if i not in failed and i not in skip and (proposals[i] is None or proposals[i].parents is None))
    try:
        if argmax:
            ids = model.forward_argmax(block.to(model.device), cache, **ragged)        # [n, T]
            return ChainScores(None, None, T, failed, time.perf_counter() - t, argmax=ids)
        out = forward(model, block.to(model.device), cache, feats, **ragged)
    except Exception as e:  # noqa: BLE001 - the rows that cause it end, not the batch
        log.warning("a batched forward of %d rows failed (%s: %s): scoring each row alone", len(rows),
                    type(e).__name__, e)
        logits, hidden = score_alone(model, block, proposals, feats, failed, row_cache, skip)
        return ChainScores(logits, hidden, T, failed, time.perf_counter() - t, alone=True)
    logits, hidden = (out.logits, out.hidden) if feats else (out, None)           # [n, T, V], [n, T, hid]
    return ChainScores(logits, hidden, T, failed, time.perf_counter() - t)


def score_alone(model, block: torch.Tensor, proposals: list[Proposal | None], feats: bool, failed: dict[int, str],
                row_cache, skip: frozenset[int] = frozenset()) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """block [n, T]: each chain row's real tokens scored by a forward of its own (what a failed batched forward
    falls back to); a row whose forward fails too is put in `failed`. Returns logits [n, T, V] and hidden
    [n, T, hid] (None: no row scored; no features asked for)."""
    n, T = block.shape
    logits = hidden = None
    for i, p in enumerate(proposals):
        if i in failed or i in skip or (p is not None and p.parents is not None):
            continue                                # failed already; a tree row is scored on its own anyway
        real = 1 + (p.k if p is not None else 0)
        try:
            out = forward(model, block[i: i + 1, :real].to(model.device), row_cache(i), feats)
        except Exception as e:  # noqa: BLE001 - one request's failure is its own
            log.exception("a request failed in its forward")
            failed[i] = engine_error(e)
            continue
        lg, hd = (out.logits, out.hidden) if feats else (out, None)                    # [1, real, V], [1, real, hid]
        if logits is None:
            logits = lg.new_zeros(n, T, lg.shape[-1])                                  # [n, T, V]
            hidden = hd.new_zeros(n, T, hd.shape[-1]) if hd is not None else None      # [n, T, hid]
        logits[i, :real] = lg[0]
        if hidden is not None:
            hidden[i, :real] = hd[0]
    return logits, hidden

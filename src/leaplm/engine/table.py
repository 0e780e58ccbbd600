"""The row table of a batch: which request holds which row of the target KV cache, and its prompt's prefill.

Decoding rows occupy cache rows [0, decoding), rows still prefilling [decoding, n). A row that leaves has another
moved into its place (KVCache.move_row) so both ranges stay dense.

Prefill: a joining row's prompt (all its tokens but the last, which opens its first step) goes into the cache
before the row decodes. Without a token budget it is prefilled whole when the row joins (`prefill_joining`). With
one (max_num_batched_tokens, vLLM's name) each step first spends what the decoding rows leave of the budget on
the prompts of the rows still prefilling, in order (`prefill`): a long prompt delays the running streams by one
chunk per step instead of by its whole prefill.
"""
from __future__ import annotations

import logging
import time

import torch

from .row import Row, RowOutput, engine_error
from .scoring import forward

log = logging.getLogger(__name__)

MIN_CHUNK = 32     # prompt tokens a step prefills at least, however many the decoding rows take of the budget
PAD_SLACK = 64     # cache slots (and positions) past max_len for the padding of a row near its end: the largest K


class RowTable:
    """Rows of one target KV cache: rows[i] <-> cache row i (see the module docstring)."""

    def __init__(self, model, max_rows: int, max_len: int, max_num_batched_tokens: int | None):
        self.model = model
        self.max_rows = max_rows
        self.max_num_batched_tokens = max_num_batched_tokens
        # slots past max_len for padding (positions too, where the model has them): see room()
        self.cache = model.new_cache(max_rows, min(max_len + PAD_SLACK, model.max_len))
        self.rows: list[Row] = []                        # row i of the cache <-> rows[i]
        self.decoding = 0                                # rows [0, decoding) decode, the rest still prefill

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.max_rows

    def row_cache(self, i: int):
        """Row i as a batch-1 cache (the cache itself when it has one row)."""
        return self.cache if self.cache.batch_size == 1 else self.cache.row_view(i)

    def room(self, rows: list[Row]) -> int:
        """The largest K the cache fits: every row gets 1 + K slots written, padding included, so K must fit the
        fullest row. Each row's drafts are capped by its own room (the plan), so with PAD_SLACK slots past max_len
        a row near its end caps only itself; only where the model has no positions left for the padding does it
        cap the step."""
        return self.cache.max_len - 1 - max(len(r.req.tokens) - 1 for r in rows)

    # --- joining and leaving -------------------------------------------------------------------------------------
    def prefill_joining(self, ids: list[int], proposer, whole: bool, logits_of_prompt: bool
                        ) -> torch.Tensor | None:
        """Empty the next free row and, when whole, prefill prompt ids[:-1] into it at once (else the steps prefill
        it in chunks). Returns the prompt's logits [L, V] when asked for and there are any (else None). The row is
        left empty when the forward fails."""
        i = len(self.rows)
        self.cache.truncate(0, i)
        if len(ids) <= 1 or not whole:
            return None
        try:
            feats = proposer is not None and proposer.reads_hidden
            out = forward(self.model, torch.tensor([ids[:-1]], device=self.model.device), self.row_cache(i), feats,
                          last_only=not logits_of_prompt)
            if feats:
                proposer.observe_hidden(0, out.hidden[0])
        except Exception:
            self.cache.truncate(0, i)
            raise
        self.cache.advance(len(ids) - 1, i)
        return (out.logits if feats else out)[0] if logits_of_prompt else None

    def add(self, row: Row) -> None:
        """Row n: the cache row prefill_joining just filled (or an empty one, for a chunked prefill)."""
        i = len(self.rows)
        self.rows.append(row)
        if not row.prefilling and self.decoding == i:
            self.decoding += 1

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

    # --- chunked prefill -----------------------------------------------------------------------------------------
    def prefill(self, decode_tokens: int) -> list[RowOutput]:
        """Spend this step's prefill budget on the rows still prefilling, in order; a row whose prompt is in is
        promoted to decoding (it decodes in this step). decode_tokens: what the decoding rows take of the budget.
        Returns the rows whose prefill failed (removed)."""
        budget = None
        if self.max_num_batched_tokens is not None:
            # what the decoding rows leave of the budget, at least a small chunk
            budget = max(self.max_num_batched_tokens - decode_tokens, min(self.max_num_batched_tokens, MIN_CHUNK))
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
                    out = forward(self.model, torch.tensor([ids[r.prefilled: r.prefilled + n]],
                                                           device=self.model.device),
                                  self.row_cache(i), feats, last_only=True)
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

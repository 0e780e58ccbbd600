"""The KV caches of libllama models (see the package docstring: rows, rollback, trees, logits, hidden): one context
whose sequences are the rows (LlamaCppCache), rows in contexts of their own (LlamaCppRows), a row seen as a batch-1
cache (LlamaCppRowView). Same interface as cache.kv_cache.KVCache. `lm` is the LlamaCppLM (model.py) they belong
to."""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ... import faults
from ..base import Scored
from .binding import log_count, recent_log

N_BATCH = 512          # batch entries per llama_decode (a longer prefill is split; a tree must fit in one)
ROW_N_BATCH = 128      # the same for a row's own context (LlamaCppRows): its compute buffer scales with it
TREE_SEQS = 64         # scratch sequences for a tree block's leaves
TREE_SLACK = 512       # KV cells beyond rows * max_len: a tree block's nodes live in scratch sequences
KV_BYTES = {0: 4, 1: 2, 30: 2}
_contexts = [0]                                # llama.cpp contexts alive in this process (created - freed)
_contexts_lock = threading.Lock()


def live_contexts() -> int:
    """llama.cpp contexts created and not freed yet, every model's (what a leak of contexts would grow)."""
    return _contexts[0]


@dataclass
class TreeSeqs:
    """The last tree block scored for a row: where its tokens live until commit."""
    row: int
    start: int               # the row's committed length (the root's position)
    seq_of: list[int]        # block row -> a sequence holding it and its ancestors (the root: the row itself)


def tree_parents(mask: torch.Tensor, depths: list[int]) -> list[int]:
    """Parent block row of every block row (-1 for row 0, the root) of a block mask [T, T] that is a tree:
    every row sees the root, itself and exactly what its parent sees, at its parent's depth + 1. ValueError
    for any other mask (llama.cpp's sequences can express only trees)."""
    m = mask.tolist()
    T = len(m)
    if not m[0][0] or any(m[0][1:]):
        raise ValueError("a tree block's row 0 (the root) must see itself only")
    parents = [-1]
    for r in range(1, T):
        seen = [c for c in range(T) if m[r][c] and c != r]
        if not m[r][r] or not seen or max(seen) >= r:
            raise ValueError(f"block row {r} does not see itself and earlier rows only: not a tree llama.cpp "
                             "can score")
        p = max(seen)
        want = [c for c in range(T) if m[p][c]]
        if seen != want or depths[r] != depths[p] + 1:
            raise ValueError(f"block row {r}'s mask is not its parent's plus itself: not a tree llama.cpp "
                             "can score")
        parents.append(p)
    return parents


class _CacheSizes:
    """What the server's metrics and admission read of a libllama cache, and the room checks (both caches: they
    have lm, max_len, lengths and batch_size)."""

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as libllama holds them."""
        return self.lm.weight_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.lm.bytes_per_token

    @property
    def capacity(self) -> int:
        return self.max_len

    @property
    def capacity_tokens(self) -> int:
        return self.batch_size * self.max_len

    def check_room(self, T: int, B: int = 1) -> None:
        longest = max(self.lengths[:B])
        if longest + T > self.max_len:
            raise ValueError(f"KV cache full: {longest} + {T} tokens exceed max_len={self.max_len}")

    def reserve(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(f"KV cache full: {needed} slots exceed max_len={self.max_len}")

    def advance(self, n: int, row: int = 0) -> None:
        self.lengths[row] += n


class LlamaCppCache(_CacheSizes):
    """One llama.cpp context: rows [0, batch_size) are its sequences (see the module docstring). Same interface as
    cache.kv_cache.KVCache: lengths, advance, truncate, compact, move_row, row_view, reset_row, check_room."""

    def __init__(self, lm, batch_size: int, max_len: int, lengths: "list[int] | _RowLength | None" = None,
                 n_batch: int = N_BATCH):
        """lengths: the committed lengths to keep (LlamaCppRows hands each row's context a view of its own
        list); n_batch: batch entries per llama_decode."""
        lc = lm.lc
        self.lm, self.lc = lm, lc
        self.max_len = max_len
        self.n_batch = n_batch
        self.lengths = lengths if lengths is not None else [0] * batch_size   # committed tokens per row
        self.written = [0] * batch_size        # positions [0, written[b]) may hold cells in sequence b
        self.tree: TreeSeqs | None = None
        self.n_seq = batch_size + TREE_SEQS
        if self.n_seq > 256:
            raise ValueError(f"the llama.cpp backend runs at most {256 - TREE_SEQS} rows, got {batch_size}")
        cp = lc.llama_context_default_params()
        self.n_ctx = batch_size * max_len + TREE_SLACK
        cp.n_ctx = self.n_ctx
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = self.n_seq
        cp.kv_unified = True
        threads = lm.threads or torch.get_num_threads()
        cp.n_threads = cp.n_threads_batch = threads
        cp.type_k = cp.type_v = lm.kv_type
        cp.flash_attn_type = lm.flash_attn
        cp.embeddings = False
        cp.no_perf = True
        seen = log_count()
        ctx = lc.llama_init_from_model(lm._model, cp)
        if not ctx:
            raise RuntimeError(f"libllama could not create a context of {self.n_ctx} cells for {batch_size} rows "
                               f"({recent_log(seen) or 'no reason given'})")
        self.ctx = ctx
        self.mem = lc.llama_get_memory(ctx)
        self.batch = lc.llama_batch_init(n_batch, 0, self.n_seq)
        with _contexts_lock:
            _contexts[0] += 1
        self._free = weakref.finalize(self, _free_context, lc, ctx, self.batch, lm)
        b = self.batch
        self._tok = np.ctypeslib.as_array(b.token, (n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, (n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, (n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, (n_batch,))
        self._seq = [b.seq_id[i] for i in range(n_batch)]
        self._embeddings = False
        self.peak_nbytes = self.nbytes

    def set_threads(self, n: int) -> None:
        """The threads of this context's later forwards (one-token and batch alike)."""
        self.lc.llama_set_n_threads(self.ctx, n, n)

    # --- sizes (what the server's metrics and admission read) ----------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of the KV cells allocated (libllama allocates them all with the context)."""
        return self.n_ctx * self.bytes_per_token

    def held(self) -> tuple[int, int]:
        """(KV cells, sequences holding any) as llama.cpp reports them: each sequence's position range, asked of
        the context (its rows and the tree scratch sequences), not read from this object's lengths."""
        cells = seqs = 0
        for s in range(self.n_seq):
            hi = self.lc.llama_memory_seq_pos_max(self.mem, s)
            if hi >= 0:
                cells += hi - self.lc.llama_memory_seq_pos_min(self.mem, s) + 1
                seqs += 1
        return cells, seqs

    # --- llama.cpp memory ------------------------------------------------------------------------------------------
    def _rm(self, seq: int, p0: int, p1: int = -1) -> None:
        self.lc.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def sync(self, seq: int, length: int) -> None:
        """Before a forward of row `seq` at `length`: drop what earlier forwards wrote past it."""
        if self.written[seq] > length:
            self._rm(seq, length)
            self.written[seq] = length

    def clear_tree(self) -> None:
        if self.tree is not None:
            for s in set(self.tree.seq_of):
                if s >= self.batch_size:
                    self._rm(s, -1)
            self.tree = None

    # --- commit-time operations ------------------------------------------------------------------------------------
    def truncate(self, length: int, row: int = 0) -> None:
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"truncate to {length} outside [0, {self.lengths[row]}]")
        self.lengths[row] = length
        self._rm(row, length)
        self.written[row] = length

    def reset_row(self, row: int) -> None:
        self.lengths[row] = 0
        self._rm(row, 0)
        self.written[row] = 0

    def compact(self, offsets: list[int], row: int = 0) -> None:
        """After a tree block of `row`: make its kept path (block rows `offsets`, root first) the row's cells from
        its length on: the path's sequence, copied into the row's (cells are shared, not copied)."""
        tree = self.tree
        if tree is None or tree.row != row or tree.start != self.lengths[row]:
            if any(o != i for i, o in enumerate(offsets)):
                raise ValueError("compact: no tree block was scored for this row")
            return
        last = offsets[-1]
        L = tree.start
        if last != 0:
            self._rm(row, L + 1)
            self.lc.llama_memory_seq_cp(self.mem, tree.seq_of[last], row, L + 1, L + len(offsets))
        self.written[row] = L + len(offsets)
        self.clear_tree()

    def move_row(self, src: int, dst: int) -> None:
        """Row src's committed cells become row dst's too (shared cells: no copy)."""
        self.sync(src, self.lengths[src])
        self._rm(dst, -1)
        n = self.lengths[src]
        if n:
            self.lc.llama_memory_seq_cp(self.mem, src, dst, 0, n)
        self.lengths[dst] = self.written[dst] = n

    def row_view(self, row: int) -> "LlamaCppRowView":
        return LlamaCppRowView(self, row)

    # --- one decode ------------------------------------------------------------------------------------------------
    def tree_entries(self, row: int, L: int, ids: list[int], mask: torch.Tensor, depths: torch.Tensor | None):
        """Batch entries (token, position, sequences, output) of a tree block of `row` at committed length L."""
        T = len(ids)
        dl = depths.tolist() if depths is not None else list(range(T))
        if T > self.n_batch:
            raise ValueError(f"a tree block of {T} tokens exceeds one llama_decode ({self.n_batch})")
        parents = tree_parents(mask, dl)
        kids = [0] * T
        for p in parents[1:]:
            kids[p] += 1
        leaves = [r for r in range(T) if kids[r] == 0 and r > 0]
        if len(leaves) > TREE_SEQS:
            raise ValueError(f"a tree block with {len(leaves)} leaves exceeds the {TREE_SEQS} scratch sequences")
        self.clear_tree()
        under: list[list[int]] = [[] for _ in range(T)]
        for j, leaf in enumerate(leaves):
            s = self.batch_size + j
            self._rm(s, -1)
            if L:
                self.lc.llama_memory_seq_cp(self.mem, row, s, 0, L)
            r = leaf
            while r > 0:
                under[r].append(s)
                r = parents[r]
        under[0] = [row] + [self.batch_size + j for j in range(len(leaves))]
        self.tree = TreeSeqs(row, L, [row] + [under[r][0] for r in range(1, T)])
        self.written[row] = max(self.written[row], L + 1)
        return [(ids[r], L + dl[r], tuple(under[r]), True) for r in range(T)], T

    def decode(self, entries, rows_out, B: int, T: int, last_only: bool, hidden: bool, hidden_all: bool) -> Scored:
        """Run the entries through llama_decode (N_BATCH at a time) and gather logits [B, T | 1, V] and, with
        hidden, the hidden states [B, T, hid]."""
        lc, V = self.lc, self.lm.vocab_size
        if hidden != self._embeddings:
            lc.llama_set_embeddings(self.ctx, hidden)
            self._embeddings = hidden
        # gathered with numpy: a torch copy wakes torch's thread pool, which on a busy CPU costs milliseconds
        logits = np.zeros((B, 1 if last_only else T, V), dtype=np.float32)                 # [B, T | 1, V]
        hid = np.zeros((B, T, self.lm.hidden_size), dtype=np.float32) if hidden else None  # [B, T, hid]
        full = len(entries) == B * T
        for c0 in range(0, len(entries), self.n_batch):
            chunk = entries[c0: c0 + self.n_batch]
            n = len(chunk)
            self._tok[:n] = [e[0] for e in chunk]
            self._pos[:n] = [e[1] for e in chunk]
            self._nseq[:n] = [len(e[2]) for e in chunk]
            self._out[:n] = [1 if (e[3] or hidden) else 0 for e in chunk]
            for i, e in enumerate(chunk):
                ptr = self._seq[i]
                for j, s in enumerate(e[2]):
                    ptr[j] = s
            self.batch.n_tokens = n
            seen = log_count()
            if faults.PLAN and faults.at("llamacpp", int(self._pos[:n].max())):
                rc = 1                         # injected (faults.py): what a context without free cells returns
            else:
                rc = lc.llama_decode(self.ctx, self.batch)
            if rc != 0:
                what = {1: "no free KV cells", 2: "aborted", -1: "invalid batch"}.get(rc, "error")
                raise RuntimeError(f"llama_decode failed ({rc}: {what}): {recent_log(seen) or 'no reason given'}")
            outs = [c0 + i for i, e in enumerate(chunk) if e[3] or hidden]      # entry index of each output row
            if not outs:
                continue
            lg = np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), (len(outs), V))          # [n_out, V]
            where = [rows_out[i] for i in outs]
            if hidden:
                emb = np.ctypeslib.as_array(lc.llama_get_embeddings(self.ctx), (len(outs), self.lm.hidden_size))
                hid[[w[0] for w in where], [w[1] for w in where]] = emb
            keep = [(k, w) for k, w in enumerate(where) if not last_only or w[1] == T - 1]
            if not keep:
                continue
            if full and not last_only and len(keep) == B * T:
                logits.reshape(B * T, V)[:] = lg
            elif len(keep) == 1:
                k, w = keep[0]
                logits[w[0], 0 if last_only else w[1]] = lg[k]
            else:
                logits[[w[0] for _, w in keep], [0 if last_only else w[1] for _, w in keep]] = \
                    lg[[k for k, _ in keep]]
        return Scored(torch.from_numpy(logits), torch.from_numpy(hid) if hidden else None)


class _RowLength:
    """Row `row` of a LlamaCppRows' lengths, seen by that row's own context as its one-row `lengths` list."""

    def __init__(self, owner: list[int], row: int):
        self.owner, self.row = owner, row

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.owner[self.row]][i]
        if i not in (0, -1):
            raise IndexError(i)
        return self.owner[self.row]

    def __setitem__(self, i, value: int) -> None:
        if i not in (0, -1):
            raise IndexError(i)
        self.owner[self.row] = value

    def __iter__(self):
        return iter([self.owner[self.row]])


class LlamaCppRows(_CacheSizes):
    """Rows in llama.cpp contexts of their own (see the module docstring: a row's attention must not depend on
    where other rows' cells lie). Same interface as LlamaCppCache; `lengths` is one list, each row's context
    reads and writes its own entry. Moving a row moves its context (nothing is copied)."""

    def __init__(self, lm, batch_size: int, max_len: int):
        self.lm = lm
        self.max_len = max_len
        self.lengths = [0] * batch_size        # committed tokens per row
        self.rows = [LlamaCppCache(lm, 1, max_len, _RowLength(self.lengths, b), n_batch=ROW_N_BATCH)
                     for b in range(batch_size)]
        self.peak_nbytes = self.nbytes

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    def held(self) -> tuple[int, int]:
        """(KV cells, sequences holding any) over the rows' contexts, as llama.cpp reports them."""
        per = [r.held() for r in self.rows]
        return sum(c for c, _ in per), sum(s for _, s in per)

    def truncate(self, length: int, row: int = 0) -> None:
        self.rows[row].truncate(length, 0)

    def reset_row(self, row: int) -> None:
        self.rows[row].reset_row(0)

    def compact(self, offsets: list[int], row: int = 0) -> None:
        self.rows[row].compact(offsets, 0)

    def move_row(self, src: int, dst: int) -> None:
        """Row src's committed cells become row dst's: src's context moves to dst (its cells stay where they
        are, so dst decodes on exactly as src would have) and src gets dst's old context, emptied. Unlike a
        shared context's move, src is left empty: the engine frees src right after a move anyway."""
        if src == dst:
            return
        a, b = self.rows[src], self.rows[dst]
        a.sync(0, self.lengths[src])
        self.rows[dst], self.rows[src] = a, b
        a.lengths.row, b.lengths.row = dst, src
        self.lengths[dst] = self.lengths[src]
        self.lengths[src] = 0
        b.clear_tree()
        b._rm(0, -1)
        b.written[0] = 0

    def row_view(self, row: int) -> "LlamaCppRowView":
        return LlamaCppRowView(self.rows[row], 0)



def _free_context(lc, ctx, batch, lm) -> None:
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    with _contexts_lock:
        _contexts[0] -= 1


class LlamaCppRowView:
    """Row `row` of a LlamaCppCache seen as a batch-1 cache (the step prefills a joining row through it). Its
    length is a copy; commits go to the parent (advance(n, row) there)."""

    def __init__(self, parent: LlamaCppCache, row: int):
        self.parent, self.row = parent, row
        self.lengths = [parent.lengths[row]]
        self.max_len = parent.max_len

    @property
    def batch_size(self) -> int:
        return 1

    def check_room(self, T: int, B: int = 1) -> None:
        if self.lengths[0] + T > self.max_len:
            raise ValueError(f"KV cache full: {self.lengths[0]} + {T} tokens exceed max_len={self.max_len}")



"""A key/value cache for a batch of sequences, each with its own length, grown in chunks as they grow.

The rule that makes rollback free: a forward over T new tokens of row b writes their keys and values into
slots [lengths[b], lengths[b] + T) but does not move lengths[b]; attention never reads a slot at or past
a row's length except the ones the current forward just wrote. So "keeping n of the T tokens" is
`lengths[b] += n`, and "rejecting" them is doing nothing: the stale slots are overwritten by the next
forward. Tree verification keeps a path of non-contiguous nodes; `compact` moves those few slots to be
contiguous first. tests/cache/test_kv_cache.py checks both against a fresh prefill.

Memory follows the work: `max_len` is the limit a row may reach, `capacity` the slots allocated per row now.
check_room (called by every forward before it writes) grows the capacity to the next multiple of CHUNK at
least doubling it, copying the committed slots (amortized O(1) per token); when every row is empty again the
cache drops back to one chunk. A model whose config allows 131072 positions thus holds what its requests use.

A layer with a sliding window W (Gemma 3's local layers, Mistral's) keeps a ring of W + RING_BLOCK slots instead,
whatever the context: slot j lives at j % ring. Why the window's keys survive a forward and its rollback: a forward
at length L writes slots L .. L + T - 1 (T <= RING_BLOCK), each overwriting the slot `ring` before it, so every slot
from L + T - ring = L + T - W - RING_BLOCK on is intact. A query at position p reads keys at positions (= slots, once
committed) p - W + 1 and later; every query of the forward, and of any later one after the row is committed or rolled
back to a length L' >= L + T - RING_BLOCK - 1, has p >= L', so it reads only intact slots. advance and truncate
refuse a deeper rollback; rollback stays a length move. A longer forward (a prefill) runs in chunks of at most
RING_BLOCK tokens (models/llama.py), each written before the next.
"""
from __future__ import annotations

import torch

CHUNK = 256          # slots per row allocated at a time
RING_BLOCK = 256     # a ring layer's slots beyond its window: the most tokens one forward writes (and rolls back)


class KVCache:
    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", capacity: int | None = None,
                 windows: list[int | None] | None = None):
        """windows: per layer, its sliding window (None: full attention); a windowed layer keeps a ring of
        window + RING_BLOCK slots (at most max_len)."""
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        # per layer: the ring's slots, 0 for a layer whose storage grows with its rows
        self.rings = [0 if not w or w + RING_BLOCK >= max_len else w + RING_BLOCK for w in (windows or [None] * n_layers)]
        self.written = [0] * batch_size    # per row: the end of the slots the last forward wrote (rollback's bound)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_len = max_len
        self.lengths = [0] * batch_size  # committed tokens per row (host ints: read on every forward)
        self.k: list[torch.Tensor] = []  # [B, Hkv, capacity, D] per layer
        self.v: list[torch.Tensor] = []
        self.capacity = 0
        self.peak_nbytes = 0
        self._allocate(min(max_len, CHUNK) if capacity is None else min(max_len, capacity))

    def _allocate(self, capacity: int, keep: int = 0) -> None:
        """New storage of `capacity` slots per row, the first `keep` slots of every row copied over (ring layers keep
        theirs)."""
        shape = (self.batch_size, self.n_kv_heads, capacity, self.head_dim)
        old_k, old_v = self.k, self.v
        self.k, self.v = [], []
        with torch.inference_mode(False):   # normal tensors even when a forward grows us: commit-time ops
            if any(self.rings):             # (compact, move_row) run outside inference mode
                self._fill_layers(shape, old_k, old_v, keep)
            else:
                self._fill(shape, old_k, old_v, keep)
        self.capacity = capacity
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)

    def _fill(self, shape, old_k, old_v, keep: int) -> None:
        if not old_k:
            # the first storage: one zeroed block, every layer's K and V a view of it (one allocation and one
            # fill instead of 2 x n_layers small ones, each of which wakes torch's threads)
            whole = torch.zeros((2 * self.n_layers, *shape), dtype=self.dtype, device=self.device)
            self.k, self.v = list(whole[0::2].unbind(0)), list(whole[1::2].unbind(0))
            return
        for i in range(self.n_layers):
            for old, new in ((old_k, self.k), (old_v, self.v)):
                # zeros, not empty: a short row's slots up to the batch's longest row are read (masked), and
                # uninitialized memory may hold NaN, which a zero attention weight does not cancel
                t = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if keep:
                    t[:, :, :keep] = old[i][:, :, :keep]
                if old:
                    old[i] = None   # free layer by layer: growth never holds two whole caches
                new.append(t)

    def _fill_layers(self, shape, old_k, old_v, keep: int) -> None:
        """_fill for a cache with ring layers: those are allocated once at their ring's size and kept."""
        for i, ring in enumerate(self.rings):
            for old, new in ((old_k, self.k), (old_v, self.v)):
                if ring and old:
                    new.append(old[i])
                    continue
                t = torch.zeros((*shape[:2], ring or shape[2], shape[3]), dtype=self.dtype, device=self.device)
                if keep and old:
                    t[:, :, :keep] = old[i][:, :, :keep]
                if old:
                    old[i] = None
                new.append(t)

    def layer_slots(self, layer: int) -> int:
        """Slots per row the layer's storage holds now."""
        return self.k[layer].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (every layer's K and V)."""
        per_slot = 2 * self.batch_size * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        if not any(self.rings):
            return self.n_layers * self.capacity * per_slot
        return sum(self.layer_slots(i) for i in range(self.n_layers)) * per_slot

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one row takes (every layer's K and V)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def capacity_tokens(self) -> int:
        return self.batch_size * self.capacity

    def reserve(self, needed: int) -> None:
        """Make room for `needed` slots per row (growing in chunks, at least doubling); never beyond max_len."""
        if needed <= self.capacity:
            return
        cap = max(needed, 2 * self.capacity)
        cap = min(self.max_len, -(-cap // CHUNK) * CHUNK)
        self._allocate(cap, keep=self.capacity)   # every slot, not only committed ones: a forward's uncommitted
        # slots (a layer-skip draft's, a chain block before a tree row's forward) may still be read

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def held(self) -> tuple[int, int]:
        """(token slots committed, rows holding any): what this cache's storage holds for its rows (the same
        interface as the llama.cpp caches, which ask libllama)."""
        return sum(self.lengths), sum(1 for n in self.lengths if n > 0)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values ([B, Hkv, T, D]) at each row's [length, length + T) (a ring layer: modulo its ring)."""
        B, T = k.shape[0], k.shape[2]
        ring = self.rings[layer]
        if ring and any((s % ring) + T > ring for s in self.lengths[:B]):
            for b in range(B):
                idx = torch.arange(self.lengths[b], self.lengths[b] + T, device=self.device) % ring
                self.k[layer][b, :, idx] = k[b]
                self.v[layer][b, :, idx] = v[b]
            return
        if ring:
            starts = [s % ring for s in self.lengths[:B]]
            for b in range(B):
                self.k[layer][b, :, starts[b]: starts[b] + T] = k[b]
                self.v[layer][b, :, starts[b]: starts[b] + T] = v[b]
            return
        if B == 1:
            s = self.lengths[0]
            self.k[layer][:1, :, s : s + T] = k
            self.v[layer][:1, :, s : s + T] = v
            return
        for b in range(B):
            s = self.lengths[b]
            self.k[layer][b, :, s : s + T] = k[b]
            self.v[layer][b, :, s : s + T] = v[b]

    def check_room(self, T: int, B: int = 1) -> None:
        """Before a forward writes T tokens to rows [0, B): refuse past max_len, grow the storage if needed."""
        longest = max(self.lengths[:B])
        if longest + T > self.max_len:
            raise ValueError(f"KV cache full: {longest} + {T} tokens exceed max_len={self.max_len}")
        for b in range(B):
            self.written[b] = self.lengths[b] + T
        self.reserve(longest + T)

    def _check_rollback(self, length: int, row: int) -> None:
        """A ring layer holds what a row of `length` tokens reads only if length is within RING_BLOCK + 1 tokens of
        the last forward's end (module docstring)."""
        if 0 < length < self.written[row] - RING_BLOCK - 1:
            raise ValueError(f"a sliding-window cache cannot roll back to {length} tokens: the last forward wrote up "
                             f"to {self.written[row]}, and at most {RING_BLOCK + 1} of its tokens may be dropped")

    def _shrink_if_empty(self) -> None:
        if self.capacity > CHUNK and not any(self.lengths):
            self._allocate(min(self.max_len, CHUNK))

    # --- commit-time operations: the only ones that change state -------------------------------------------
    def advance(self, n: int, row: int = 0) -> None:
        """Keep the first n tokens written by the last forward of `row`."""
        if any(self.rings):
            self._check_rollback(self.lengths[row] + n, row)
        self.lengths[row] += n

    def truncate(self, length: int, row: int = 0) -> None:
        """Roll back `row` to its first `length` tokens."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"truncate to {length} outside [0, {self.lengths[row]}]")
        if any(self.rings):
            self._check_rollback(length, row)
        self.lengths[row] = length
        if length == 0:
            self._shrink_if_empty()

    def compact(self, offsets: list[int], row: int = 0) -> None:
        """After a tree forward: make the written slots at lengths[row] + offsets contiguous from lengths[row].

        offsets are increasing positions within the last forward (a root-to-leaf path); only len(offsets)
        slots move, and slots already in place are skipped. Does not advance.
        """
        s = self.lengths[row]
        src = [s + o for i, o in enumerate(offsets) if o != i]
        if not src:
            return
        dst = [s + i for i, o in enumerate(offsets) if o != i]
        src_t = torch.tensor(src, device=self.k[0].device)
        dst_t = torch.tensor(dst, device=self.k[0].device)
        for kv in (self.k, self.v):
            for t, ring in zip(kv, self.rings):
                if ring:
                    t[row, :, dst_t % ring] = t[row, :, src_t % ring]
                else:
                    t[row, :, dst_t] = t[row, :, src_t]

    def reset_row(self, row: int) -> None:
        self.lengths[row] = self.written[row] = 0
        self._shrink_if_empty()

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src to row dst (the server keeps its running requests in rows [0, n))."""
        n = self.lengths[src]
        for kv in (self.k, self.v):
            for t, ring in zip(kv, self.rings):
                m = min(n, ring) if ring else n        # a ring holds its slots wherever the row's length left them
                t[dst, :, :m] = t[src, :, :m]
        self.lengths[dst] = n
        self.written[dst] = n

    def row_view(self, row: int) -> "RowView":
        """Row `row` seen as a batch-1 cache: its k/v are views of this cache's storage, its length a copy.

        The batch scheduler prefills a joining request through it, then commits with advance(n, row) here.
        """
        return RowView(self, row)


class RowView(KVCache):
    """One row of a parent cache as a batch-1 cache. Growth goes to the parent (every row grows together),
    after which the view re-slices the parent's new storage."""

    def __init__(self, parent: KVCache, row: int):   # no storage of its own: slices of the parent's
        self.parent, self.row = parent, row
        self.n_layers, self.n_kv_heads, self.head_dim = parent.n_layers, parent.n_kv_heads, parent.head_dim
        self.dtype, self.device, self.max_len = parent.dtype, parent.device, parent.max_len
        self.rings = parent.rings
        self.lengths = [parent.lengths[row]]
        self.written = [parent.written[row]]
        self.peak_nbytes = 0
        self._slice()

    def _slice(self) -> None:
        r = self.row
        self._source = self.parent.k                       # the parent's list: replaced when it reallocates
        self.k = [t[r: r + 1] for t in self.parent.k]     # [1, Hkv, capacity, D] per layer, shared storage
        self.v = [t[r: r + 1] for t in self.parent.v]
        self.capacity = self.parent.capacity

    def check_room(self, T: int, B: int = 1) -> None:
        super().check_room(T, B)
        self.parent.written[self.row] = self.written[0]      # what the parent's commit checks a rollback against

    def reserve(self, needed: int) -> None:
        if needed > self.parent.capacity:
            self.parent.reserve(needed)
        if self._source is not self.parent.k:
            self._slice()

    def _shrink_if_empty(self) -> None:   # the parent decides (other rows may hold tokens)
        pass

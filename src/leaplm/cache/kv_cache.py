"""A preallocated key/value cache for a batch of sequences, each with its own length.

The rule that makes rollback free: a forward over T new tokens of row b writes their keys and values into
slots [lengths[b], lengths[b] + T) but does not move lengths[b]; attention never reads a slot at or past
a row's length except the ones the current forward just wrote. So "keeping n of the T tokens" is
`lengths[b] += n`, and "rejecting" them is doing nothing: the stale slots are overwritten by the next
forward. Tree verification keeps a path of non-contiguous nodes; `compact` moves those few slots to be
contiguous first. tests/cache/test_kv_cache.py checks both against a fresh prefill.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]  # [B, Hkv, S, D] per layer
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]  # [B, Hkv, S, D] per layer
        self.max_len = max_len
        self.lengths = [0] * batch_size  # committed tokens per row (host ints: read on every forward)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values ([B, Hkv, T, D]) at each row's [length, length + T)."""
        B, T = k.shape[0], k.shape[2]
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
        longest = max(self.lengths[:B])
        if longest + T > self.max_len:
            raise ValueError(f"KV cache full: {longest} + {T} tokens exceed max_len={self.max_len}")

    # --- commit-time operations: the only ones that change state -------------------------------------------
    def advance(self, n: int, row: int = 0) -> None:
        """Keep the first n tokens written by the last forward of `row`."""
        self.lengths[row] += n

    def truncate(self, length: int, row: int = 0) -> None:
        """Roll back `row` to its first `length` tokens."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"truncate to {length} outside [0, {self.lengths[row]}]")
        self.lengths[row] = length

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
            for t in kv:
                t[row, :, dst_t] = t[row, :, src_t]

    def reset_row(self, row: int) -> None:
        self.lengths[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src to row dst (the server keeps its running requests in rows [0, n))."""
        n = self.lengths[src]
        for kv in (self.k, self.v):
            for t in kv:
                t[dst, :, :n] = t[src, :, :n]
        self.lengths[dst] = n

    def row_view(self, row: int) -> "KVCache":
        """Row `row` seen as a batch-1 cache: its k/v are views of this cache's storage, its length a copy.

        The batch scheduler prefills a joining request through it, then commits with advance(n, row) here.
        """
        view = object.__new__(KVCache)
        view.k = [t[row : row + 1] for t in self.k]     # [1, Hkv, S, D] per layer, shared storage
        view.v = [t[row : row + 1] for t in self.v]
        view.max_len = self.max_len
        view.lengths = [self.lengths[row]]
        return view

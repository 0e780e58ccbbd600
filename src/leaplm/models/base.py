"""The protocol every model behind the engine implements: native families and the transformers fallback."""
from __future__ import annotations

from typing import Protocol, Sequence

import torch


class CausalLM(Protocol):
    vocab_size: int
    num_layers: int
    max_len: int            # positions the model supports (max_position_embeddings)
    supports_tree: bool     # can take tree_mask / position_offsets
    supports_batch: bool    # can run B > 1 rows of different lengths

    def new_cache(self, batch_size: int = 1, max_len: int | None = None): ...

    def forward(self, input_ids: torch.Tensor, cache, *, tree_mask: torch.Tensor | None = None,
                position_offsets: torch.Tensor | None = None, layers: Sequence[int] | None = None,
                last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]; writes the T tokens' K/V after each row's cache length
        without moving it (the caller commits with cache.advance / truncate / compact)."""
        ...

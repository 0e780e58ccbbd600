"""The protocol every model behind the engine implements: native families and the transformers fallback."""
from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class LoadedModel:
    """A model ready to run, with its tokenizer (models/loading.py load_model, models/llamacpp/model.py)."""
    model: object            # implements CausalLM
    tokenizer: object        # transformers PreTrainedTokenizerBase
    path: str                # resolved local directory
    name: str                # what the user asked for
    config: dict             # config.json
    eos_token_ids: list[int]
    n_params: int
    bos_id: int | None = None   # BOS prepended to prompts (tokens.bos_to_add), None when the tokenizer adds none
    backend: str = "torch"      # what runs the forward: "torch" (leaplm's PyTorch models) or "llamacpp" (libllama)

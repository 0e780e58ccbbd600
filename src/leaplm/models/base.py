"""The contract of every model behind the engine: native families (llama.py), libllama (llamacpp/) and the
transformers fallback (hf.py).

  CausalLM           forward over [B, T] tokens into a KV cache, and what the model can do beyond it, declared as
                     data (ModelCapabilities): the engine and the proposers read `model.capabilities`, never probe
  ModelCapabilities  batched rows, ragged rows, trees, hidden states, layer subsets
  Scored             what forward_hidden returns: the logits and the last hidden state
  KVCacheProtocol    the cache protocol: per-row committed lengths moved by commit (advance, truncate, compact), rows
                     moved and emptied by the batch, a row seen as a batch-1 cache. A forward writes its T tokens
                     after each row's length without moving it; rolling back is moving a length, never a copy
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model can do beyond a forward over one row, as data (every field False: one row at a time)."""
    batch: bool = False            # B > 1 rows of different lengths in one forward (the step batches its rows)
    ragged_rows: bool = False      # forward(..., row_tokens=[n_b]): row b's first n_b tokens are real, the rest
                                   # padding that is neither computed nor written
    trees: bool = False            # forward(..., tree_mask, position_offsets): tree proposals (suffix, lookahead)
    hidden_states: bool = False    # forward_hidden(...) -> Scored: the target's features (EAGLE, Medusa heads)
    layer_subsets: bool = False    # forward(..., layers=[...]): some layers only (layer-skip drafting)
    greedy_chain: bool = False     # greedy_chain(ids, k, cache, real): k greedy drafts of one row in one call, or
                                   # None when this model cannot (models/one_call.py)
    argmax_head: bool = False      # forward_argmax(ids, cache, **forward's keywords) -> [B, T] long: each position's
                                   # argmax of its logits (torch.argmax's: the first maximum), the [B, T, V] logits
                                   # not written where the output layer can reduce its rows itself


@dataclass
class Scored:
    """forward_hidden's result."""
    logits: torch.Tensor | None   # [B, T, V] ([B, 1, V] with last_only); None when only the argmax was asked for
    hidden: torch.Tensor          # [B, T, hidden]: the last hidden state after the final norm (lm_head's input)
    argmax: torch.Tensor | None = None   # [B, T | 1] long: each position's argmax, when asked for instead of logits


class KVCacheProtocol(Protocol):
    """The cache a model's new_cache returns (cache/kv_cache.py, llamacpp/caches.py, hf.py's). A model without
    capabilities.batch has one-row caches: they are never asked to move rows or for a row's view."""
    lengths: list[int]       # committed tokens per row
    max_len: int             # slots per row
    peak_nbytes: int         # most bytes it has held

    @property
    def batch_size(self) -> int: ...

    def advance(self, n: int, row: int = 0) -> None:
        """Commit the next n written tokens of row."""

    def truncate(self, length: int, row: int = 0) -> None:
        """Keep row's first `length` committed tokens (0: empty the row)."""

    def compact(self, offsets: list[int], row: int = 0) -> None:
        """After a tree block: its kept path (block rows `offsets`, root first) becomes the row's next tokens."""

    def move_row(self, src: int, dst: int) -> None:
        """Row src's committed tokens become row dst's (the batch keeps its rows dense)."""

    def row_view(self, row: int) -> KVCacheProtocol:
        """Row `row` as a batch-1 cache whose forwards write into this one; commits go to this cache."""


class CausalLM(Protocol):
    vocab_size: int
    num_layers: int
    max_len: int                          # positions the model supports (max_position_embeddings)
    device: torch.device
    dtype: torch.dtype                    # of the logits (and the weights, where leaplm holds them)
    quantized: dict                       # parameter name -> leaplm's quantized stand-in (quant/apply.py); {}: none
    capabilities: ModelCapabilities

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> KVCacheProtocol: ...

    def forward(self, input_ids: torch.Tensor, cache: KVCacheProtocol, *, tree_mask: torch.Tensor | None = None,
                position_offsets: torch.Tensor | None = None, layers: Sequence[int] | None = None,
                last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]; writes the T tokens' K/V after each row's cache length
        without moving it (the caller commits with cache.advance / truncate / compact)."""
        ...

    # with capabilities.hidden_states:
    #   forward_hidden(input_ids, cache, *, ..., hidden_all=False) -> Scored
    # with capabilities.argmax_head:
    #   forward_argmax(input_ids, cache, *, ...forward's keywords) -> [B, T] long (the argmax of forward's logits)


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

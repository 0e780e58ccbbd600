"""A draft with a reduced vocabulary: it reads and proposes only the target tokens it was trained on.

A CPU draft for a target with a large vocabulary pays mostly for its LM head (and ships mostly its embedding).
A draft trained on the N tokens the target emits most (see training/chat_distill.py) keeps both at N rows; this
adapter makes it look like a model over the target's full vocabulary V:
- input: target ids map to draft ids through t2d; a target token outside the draft's vocabulary becomes the
  draft's row 0, reserved for "any other token" (trained on those inputs);
- output: the draft's logits scatter into V columns; every other column, and row 0, is -inf, so q = 0 there.
Lossless whatever q is: rejection sampling accepts a draft token with min(1, p / q) and draws recovered tokens
from max(0, p - q), which covers tokens with q = 0; greedy verification compares token ids only.

On disk: a Hugging Face llama directory (vocab_size N) plus draft_vocab.safetensors holding d2t [N] int64, the
target id of each draft row (d2t[0] = -1), and the target's tokenizer files (the engine checks them equal).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def has_draft_vocab(path: str | Path) -> bool:
    return (Path(path) / DRAFT_VOCAB_FILE).is_file()


def read_d2t(path: str | Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / DRAFT_VOCAB_FILE))["d2t"].long()      # [N]


def t2d_table(d2t: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[V] int64: the draft row of each target id, 0 (the "other" row) for ids outside the draft vocabulary."""
    t2d = torch.zeros(target_vocab, dtype=torch.long)
    keep = d2t >= 0
    t2d[d2t[keep]] = torch.arange(len(d2t))[keep]
    return t2d


class VocabMappedDraft(torch.nn.Module):
    """The CausalLM protocol (models/base.py) over the target's V tokens, around a model over N draft rows."""

    def __init__(self, inner, d2t: torch.Tensor, target_vocab: int):
        super().__init__()
        if int(d2t.max()) >= target_vocab:
            raise ValueError(f"draft_vocab: token id {int(d2t.max())} outside the target's {target_vocab}")
        self.inner = inner
        self.register_buffer("d2t_cols", d2t.clamp(min=0).to(inner.device), persistent=False)    # [N]
        self.register_buffer("t2d", t2d_table(d2t, target_vocab).to(inner.device), persistent=False)  # [V]
        self.real = (d2t >= 0).to(inner.device)                                                  # [N] bool
        self._vocab = target_vocab

    vocab_size = property(lambda self: self._vocab)
    num_layers = property(lambda self: self.inner.num_layers)
    max_len = property(lambda self: self.inner.max_len)
    device = property(lambda self: self.inner.device)
    dtype = property(lambda self: self.inner.dtype)
    quantized = property(lambda self: self.inner.quantized)
    # the inner model's, but no forward_hidden: the hidden states are not this adapter's to give
    capabilities = property(lambda self: dataclasses.replace(self.inner.capabilities, hidden_states=False,
                                                             greedy_chain=False))

    def new_cache(self, batch_size: int = 1, max_len: int | None = None):
        return self.inner.new_cache(batch_size, max_len)

    def forward(self, input_ids: torch.Tensor, cache, **kw) -> torch.Tensor:
        small = self.inner(self.t2d[input_ids], cache, **kw)                # [B, T, N]
        small = small.masked_fill(~self.real, float("-inf"))
        full = small.new_full((*small.shape[:-1], self._vocab), float("-inf"))   # [B, T, V]
        return full.index_copy_(-1, self.d2t_cols[self.real], small[..., self.real])


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id): drafts are matched to targets by this, not by path."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()

"""Reduced draft vocabularies for EAGLE heads, in the layout Speculators writes and vLLM's EAGLE-3 reads:
d2t [N] int64 holds offsets (the target id of draft row j is j + d2t[j]) and t2d [V] bool marks the target ids
kept. Rows are in increasing target id, so every offset is >= 0.

The N ids are the target tokens counted most often in the target's own answers (what the head drafts), ties
and unseen tokens ranked by a prior count (the training prompts or corpus): a token the head cannot draft costs
acceptance only where the target emits it.

Lossless whatever N is: q is zero outside the N ids, and verification accepts a draft with min(1, p / q) and
draws the recovered token from max(0, p - q), which reaches every token q leaves out.
"""
from __future__ import annotations

import torch

from ..config import ConfigError


def top_ids(counts: torch.Tensor, n: int, prior: torch.Tensor | None = None) -> torch.Tensor:
    """The n target ids ranked first by counts [V] (then by prior [V]), sorted by id: [n] int64."""
    V = counts.numel()
    if not 1 <= n <= V:
        raise ConfigError("draft_vocab", f"must be in [1, {V}] (the target's vocabulary), got {n}")
    score = counts.double()
    if prior is not None:                   # lexicographic: the prior only orders tokens of equal count
        p = prior.double()
        score = score * (p.max() + 1) + p
    return score.topk(n).indices.sort().values


def maps_of(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N] increasing target ids -> (d2t [N] int64 offsets, t2d [V] bool)."""
    d2t = ids.long() - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def ids_of(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int, where="head") -> torch.Tensor:
    """Check a stored map and return the target ids [N]; a map that points outside the vocabulary, repeats an
    id or disagrees with t2d is refused naming the file."""
    ids = torch.arange(d2t.numel()) + d2t.long()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ConfigError("head", f"{where}: d2t maps draft rows outside the target's {vocab_size} tokens")
    if ids.unique().numel() != ids.numel():
        raise ConfigError("head", f"{where}: d2t maps two draft rows to one target token")
    if t2d is not None:
        if t2d.numel() != vocab_size or int(t2d.sum()) != ids.numel() or not bool(t2d.bool()[ids].all()):
            raise ConfigError("head", f"{where}: t2d and d2t disagree")
    return ids

"""What the head recipes (eagle.py, medusa.py, eagle_chat.py) pass each other: a batch of the target's text with
its features, and one draft position's loss and statistics."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TargetBatch:
    ids: torch.Tensor                 # [B, S] long: prompt + the target's continuation
    feats: torch.Tensor               # [B, S, hid] the target's features (its logits are lm_head(feats))
    lse: torch.Tensor | None = None   # [B, S] logsumexp of the target's logits (p over a draft vocabulary)
    top: torch.Tensor | None = None   # [B, S] long: the target's argmax
    loss_mask: torch.Tensor | None = None   # [B, S] bool: features trained as targets (None: all; chat: answers)


@dataclass
class PassStats:
    loss: torch.Tensor
    kl: float
    agree: float
    accept: float                    # mean 1 - TV(p, q)

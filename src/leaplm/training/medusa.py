"""Medusa-1 heads trained by `leaplm train medusa`: the EAGLE recipe's data and loop (training/eagle.py,
kind="medusa") with this loss. Head i reads f_t and is scored by KL(p_{t+1+i} || q_i), p_{t+1+i} being the
target's distribution of token t + 2 + i (self-distillation on the target's own text, frozen target)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..heads.medusa_net import MedusaNet
from .head_data import PassStats, TargetBatch


def medusa_losses(net: MedusaNet, lm_head: torch.Tensor, b: TargetBatch) -> list[PassStats]:
    """One PassStats per head. b.feats [B, S, hid]; lm_head [V, hid] (frozen)."""
    B, S, _ = b.feats.shape
    out = []
    preds = net(b.feats)                                               # [H, B, S, hid]
    for i in range(preds.shape[0]):
        n = S - 1 - i                                                  # positions t with a label t + 1 + i
        if n < 1:
            break
        # chat batches: only answer positions (right padding and prompts are not what is drafted)
        sel = b.loss_mask[:, 1 + i:] if b.loss_mask is not None else torch.ones(B, n, dtype=torch.bool)
        logq = torch.log_softmax(F.linear(preds[i, :, :n][sel], lm_head), -1)   # [m, V]
        with torch.no_grad():
            lp = torch.log_softmax(F.linear(b.feats[:, 1 + i:][sel], lm_head), -1)   # [m, V]
        kl = (lp.exp() * (lp - logq)).sum(-1).sum() / max(1, lp.shape[0])
        with torch.no_grad():
            agree = (logq.argmax(-1) == lp.argmax(-1)).float().sum().item() / max(1, lp.shape[0])
            accept = torch.minimum(lp.exp(), logq.exp()).sum(-1).sum().item() / max(1, lp.shape[0])
        out.append(PassStats(kl, kl.item(), agree, accept))
    return out

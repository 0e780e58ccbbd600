"""A smaller model with the same tokenizer drafts K tokens autoregressively over its own KV cache.

Cache bookkeeping: before proposing, the draft feeds the committed tokens it has not seen (at least the last
one); while drafting it feeds d_1..d_{K-1}. After verification it keeps the committed prefix it has cached:
len(tokens) + min(accepted, K - 1) entries, so nothing is ever recomputed or copied.

Placement: the draft may sit on another device than the target (--draft-device). Its logits move to the
target's device (out_device) as soon as they are computed, so the logits processors, the request's generator
and the returned proposal all live where the verifier runs; only the token ids fed to the draft cross back.
"""
from __future__ import annotations

import torch

from ..verify import VerifyResult
from .base import Proposal, ProposeContext


class DraftModelProposer:
    name = "draft"
    samples = True

    def __init__(self, model, max_len: int, out_device=None):
        self.model = model                       # CausalLM, shared by all requests
        self.out_device = out_device if out_device is not None else model.device   # the target's device
        self.cache = model.new_cache(1, max_len)
        self.n_ctx = 0                           # len(tokens) at the last proposal
        self.k = 0

    def propose(self, ctx: ProposeContext) -> Proposal:
        toks = ctx.tokens
        cached = min(self.cache.lengths[0], len(toks) - 1)    # the last token is always fed: its logits draft
        self.cache.truncate(cached)
        feed = torch.tensor([toks[cached:]], device=self.model.device)   # [1, T] committed, unseen
        k = max(1, min(ctx.k, self.cache.max_len - len(toks) - 1))
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        presence = ctx.presence.clone() if ctx.presence is not None else None   # [V]
        for i in range(k):
            logits = self.model(feed, self.cache, last_only=True)[0, -1:].to(self.out_device)  # [1, V]
            self.cache.advance(feed.shape[1])
            pres = presence.unsqueeze(0) if presence is not None else None
            if ctx.generator is None:
                t = int(ctx.processor.greedy(logits, pres))
            else:
                q = ctx.processor.probs(logits, pres)                      # [1, V]
                t = ctx.sample(q, i)
                qs.append(q[0])
            drafts.append(t)
            if presence is not None:
                presence[t] = True
            if i + 1 < k:
                feed = torch.tensor([[t]], device=self.model.device)
        self.n_ctx, self.k = len(toks), k
        # the cache now holds toks + d_1..d_{k-1}
        q = torch.stack(qs) if qs else None                               # [K, V]
        return Proposal(torch.tensor(drafts, device=self.out_device), q)

    def lag(self, n_tokens: int) -> int:
        """Committed tokens the draft has not cached yet: what its next proposal must prefill first."""
        return max(0, n_tokens - self.cache.lengths[0])

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits=None) -> None:
        self.cache.truncate(self.n_ctx + min(result.accepted, self.k - 1))

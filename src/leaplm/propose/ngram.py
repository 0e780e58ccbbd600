"""Prompt lookup: find the context's last n tokens earlier in the context (prompt and output, n from ngram_max
down to ngram_min) and propose the tokens that followed the most recent match. Deterministic (q = None)."""
from __future__ import annotations

import torch

from ..config import SpecConfig
from ..verify import VerifyResult
from .base import Proposal, ProposeContext, ProposerBase, SimpleFactory
from .ngram_index import NgramIndex
from .registry import register


MAX_MATCH = 32      # how far back a match's context agreement is measured (Proposal.match)


class NgramProposer(ProposerBase):
    name = "ngram"
    samples = False
    bursty = True                # right for stretches while the output copies, wrong elsewhere
    cheap = True

    def __init__(self, n_min: int, n_max: int, device: torch.device):
        self.index = NgramIndex(n_min, n_max, keep=1)      # only the most recent match is used
        self.doc = self.index.new_doc()
        self.device = device

    def propose(self, ctx: ProposeContext) -> Proposal:
        toks = ctx.tokens
        indexed = len(self.index.docs[self.doc])
        if len(toks) > indexed:
            self.index.extend(self.doc, toks[indexed:])
        for n in range(min(self.index.n_max, len(toks) - 1), self.index.n_min - 1, -1):
            hits = self.index.lookup(tuple(toks[-n:]))
            if hits:
                draft = self.index.continuation(hits[-1], ctx.k, live=True)
                match = self.index.context_match(hits[-1], toks, n, MAX_MATCH)
                return Proposal(torch.tensor(draft, dtype=torch.long, device=self.device), match=match)
        return Proposal(torch.empty(0, dtype=torch.long, device=self.device))

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits=None) -> None:
        pass   # the index catches up with the committed tokens at the next propose


@register("ngram")
def _build(spec: SpecConfig, target, draft):
    device = target.model.device
    return SimpleFactory(lambda max_len: NgramProposer(spec.ngram_min, spec.ngram_max, device))

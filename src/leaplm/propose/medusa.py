"""Medusa-1: heads on the target's last feature propose the next tokens at once, verified as a tree.

After a step the proposer holds f_{L-2}, the target's feature of the last token in its cache (whose own logits
gave the committed last token L-1). Head i predicts the token at L + i. Tree: each head offers its top
`branch` tokens; a node at depth d extends its parent with one of head d-1's candidates, scored by the sum of
the heads' log-probabilities along the path; the K best nodes (ancestor-closed, as EAGLE's selection) are sent,
as a chain when they form one. The heads do not see the drafted tokens, which is why Medusa's acceptance falls
faster with depth than EAGLE's. Sampled requests rank each head's candidates by the seed's exponential race
at that position (coupled with the target's own sample). Verification is the engine's (exact either way).
"""
from __future__ import annotations

import torch

from ..config import ConfigError, SpecConfig
from ..heads.runtime import MedusaHeads
from ..sampling.positional import ranked
from ..verify import VerifyResult
from .base import Proposal, ProposeContext, ProposerBase, SimpleFactory
from .registry import register
from .tree_select import Node, select_tree


class MedusaProposer(ProposerBase):
    name = "medusa"
    samples = True
    reads_hidden = True

    def __init__(self, heads: MedusaHeads, max_len: int, branch: int = 3):
        self.heads = heads
        self.branch = branch
        self.last: torch.Tensor | None = None     # [hid] the target's feature of the last cached token
        self.last_pos = -1

    def observe_hidden(self, start: int, hidden: torch.Tensor) -> None:
        self.last = hidden[-1].float()
        self.last_pos = start + hidden.shape[0] - 1

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits=None) -> None:
        pass

    def propose(self, ctx: ProposeContext) -> Proposal:
        L = len(ctx.tokens)
        depth = min(ctx.k, self.heads.net.config.num_heads)
        if self.last is None or self.last_pos != L - 2 or depth < 1:
            return Proposal(torch.empty(0, dtype=torch.long))
        logits = self.heads.logits(self.last, depth)                                    # [D, V]
        if ctx.generator is None:                    # ranking only: log q, no softmax
            w = torch.log_softmax(logits.float(), -1)
        else:
            pres = ctx.presence.unsqueeze(0).expand(depth, -1) if ctx.presence is not None else None
            w = ctx.processor.probs(logits, pres)                                       # [D, V] q
        cands = []
        for d in range(depth):
            if ctx.generator is None:
                top = w[d].topk(self.branch)
                c, lq = top.indices, top.values
            else:
                if ctx.seed is not None:
                    c = torch.tensor(ranked(w[d], ctx.seed, L + d, self.branch))
                else:
                    c = torch.tensor([ctx.sample(w[d], d, j) for j in range(self.branch)])
                lq = w[d, c].log()
            cands.append(list(zip(c.tolist(), lq.tolist())))
        pool: list[Node] = []
        frontier = [-1]
        for d in range(depth):                       # expand the best `branch` paths one level deeper
            new = []
            for par in frontier:
                base = pool[par].score if par >= 0 else 0.0
                for t, lq in cands[d]:
                    pool.append(Node(t, par, base + lq, d + 1))
                    new.append(len(pool) - 1)
            frontier = sorted(new, key=lambda j: -pool[j].score)[: self.branch]
        return select_tree(pool, ctx.k)


@register("medusa")
def _medusa(spec: SpecConfig, target, draft):
    if not target.model.capabilities.hidden_states:
        raise ConfigError("method", "medusa needs a native Llama-family target (its hidden states are read)")
    from ..heads.loader import load_head_for

    heads = load_head_for(spec.head, target, kind="medusa")
    return SimpleFactory(lambda max_len: MedusaProposer(heads, max_len))

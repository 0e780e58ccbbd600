"""Lookahead decoding (Fu et al. 2024): Jacobi iteration on a window of future positions, run inside the
target forward that verifies, harvests n-grams whose first token later opens a step; those are the guesses.

The window has N - 1 levels of W tokens. Token (l, j) (level l, column j) sits at depth j + l + 1 after the
root and sees the root, level 0's columns 0..j and its own column's levels 1..l: along that path it is the
(j + l + 1)-th token of one consistent sequence. Each step the target's argmax after the last level's
tokens gives a new level; column j then yields the n-gram (level 0..N-2 of column j, new token j), keyed
by its first token; the oldest level drops out and the root moves on by at least one token, which shifts
every remaining level one position closer (exactly so when one token was committed; with more, the
window is a little stale, which costs guess quality, never correctness). Until N - 1 levels exist the
window grows a level per step and harvests nothing.

The pool also takes the n-grams of the context itself (prompt and committed output). Guesses are the G
most recent n-grams keyed by the last committed token, merged into a trie of at most K nodes. They are
deterministic (q = None), so verification is exact at any temperature; the window only decides what is
guessed. The window rides in the verifying forward as Proposal.extra, and its logits come back through
observe: no forward of its own.
"""
from __future__ import annotations

import torch

from ..config import ConfigError, SpecConfig
from ..verify import VerifyResult
from .base import ExtraTokens, Proposal, ProposeContext, ProposerBase, SimpleFactory
from .registry import register


def window_shape(levels: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask [A, A] bool and depths [A] long of a window of `levels` x `width` tokens, level-major."""
    A = levels * width
    mask = torch.zeros(A, A, dtype=torch.bool)
    depths = torch.zeros(A, dtype=torch.long)
    for l in range(levels):
        for j in range(width):
            r = l * width + j
            depths[r] = j + l + 1
            mask[r, : j + 1] = True                          # level 0, columns 0..j
            for m in range(1, l + 1):                        # own column, levels 1..l
                mask[r, m * width + j] = True
    return mask, depths


class LookaheadProposer(ProposerBase):
    name = "lookahead"
    samples = False
    bursty = True                # right for stretches while the output copies, wrong elsewhere

    def __init__(self, window: int, ngram_size: int, guess_set: int, max_len: int, device: torch.device):
        self.W, self.N, self.G = window, ngram_size, guess_set
        self.max_len = max_len
        self.device = device
        self.levels: list[list[int]] = []               # oldest first, W tokens each
        self.pool: dict[int, list[tuple[int, ...]]] = {}   # first token -> following N-1 tokens, newest last
        self.harvested = 0                               # context tokens already scanned for n-grams
        self._shapes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def propose(self, ctx: ProposeContext) -> Proposal:
        toks = ctx.tokens
        self._harvest_context(toks)
        if not self.levels:                              # first guess of the window: the latest tokens
            self.levels = [[toks[(len(toks) - self.W + j) % len(toks)] for j in range(self.W)]]
        nodes, parents = self._guess_tree(toks[-1], ctx.k)
        extra = None
        A = len(self.levels) * self.W
        if len(toks) + len(nodes) + A <= self.max_len:   # the window must fit in the cache too
            L = len(self.levels)
            if L not in self._shapes:                    # built once per level count, kept on the device
                self._shapes[L] = tuple(t.to(self.device) for t in window_shape(L, self.W))
            mask, depths = self._shapes[L]               # [A, A], [A]
            flat = [t for level in self.levels for t in level]
            extra = ExtraTokens(torch.tensor(flat, dtype=torch.long, device=self.device), mask, depths)
        return Proposal(torch.tensor(nodes, dtype=torch.long, device=self.device), parents=parents, extra=extra)

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits: torch.Tensor | None = None) -> None:
        if extra_logits is None:
            return
        L = len(self.levels)
        new = extra_logits[(L - 1) * self.W:].argmax(-1).tolist()     # [W] after the last level
        if L == self.N - 1:
            for j in range(self.W):
                gram = tuple(self.levels[l][j] for l in range(1, L)) + (new[j],)
                self._add(self.levels[0][j], gram)
            del self.levels[0]
        self.levels.append(new)

    def _harvest_context(self, toks: list[int]) -> None:
        N = self.N
        for i in range(max(self.harvested, N - 1), len(toks)):           # i: an n-gram's last position
            self._add(toks[i - N + 1], tuple(toks[i - N + 2: i + 1]))
        self.harvested = len(toks)

    def _add(self, first: int, rest: tuple[int, ...]) -> None:
        grams = self.pool.setdefault(first, [])
        if rest in grams:
            grams.remove(rest)
        grams.append(rest)
        if len(grams) > self.G:
            del grams[0]

    def _guess_tree(self, root: int, budget: int) -> tuple[list[int], list[int]]:
        """The newest guesses after `root` merged into a trie of at most `budget` nodes."""
        nodes: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}
        for gram in reversed(self.pool.get(root, [])):
            at = -1
            for t in gram:
                nxt = child.get((at, t))
                if nxt is None:
                    if len(nodes) == budget:
                        return nodes, parents
                    nxt = child[(at, t)] = len(nodes)
                    nodes.append(t)
                    parents.append(at)
                at = nxt
        return nodes, parents


@register("lookahead")
def _build(spec: SpecConfig, target, draft):
    if not target.model.capabilities.trees:
        raise ConfigError("method", "lookahead scores its window and guesses as a tree, which this model's "
                                    "adapter cannot do; use a native model family")
    device = target.model.device
    return SimpleFactory(lambda max_len: LookaheadProposer(spec.window, spec.ngram_size, spec.guess_set, max_len,
                                                           device))

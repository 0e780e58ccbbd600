"""Suffix-cache speculation: match the context's end against every text the engine has seen (this request,
earlier requests, an optional corpus) and propose a tree of the continuations that followed, the most
frequent first. Deterministic (q = None).

Per step: find the longest n in [ngram_min, ngram_max] whose n-gram ends the context and occurs somewhere;
take up to MAX_OCCURRENCES occurrences (this request's most recent first, then earlier requests', then the
corpus'); weight each by how far its match really extends back (up to MAX_MATCH tokens); merge their
continuations into a trie whose node weight is the weight of the occurrences passing through it; keep the
heaviest nodes (a node never outweighs its parent, so they form a tree) while their share of the total is at
least MIN_SHARE, at most min(K, NODES_PER_MATCHED_TOKEN * longest match) of them: longer matches predict
further and earn bigger trees.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, SpecConfig
from ..verify import VerifyResult
from .base import Proposal, ProposeContext, ProposerBase, ProposerFactory
from .ngram_index import NgramIndex
from .registry import register

log = logging.getLogger(__name__)

MAX_OCCURRENCES = 32         # occurrences remembered per n-gram and merged per step
MAX_MATCH = 32               # how far back a match is measured
NODES_PER_MATCHED_TOKEN = 2
MIN_SHARE = 0.1              # nodes followed by a smaller share of the occurrences are not worth verifying
HISTORY_TOKENS = 1 << 20     # earlier requests remembered (then the history starts afresh)


@dataclass
class Tree:
    tokens: list[int]
    parents: list[int]


def frequency_tree(continuations: list[list[int]], weights: list[float], budget: int,
                   min_share: float = MIN_SHARE) -> Tree:
    """The `budget` heaviest nodes of the trie of `continuations`, parents before children."""
    kids: list[dict[int, int]] = [{}]           # trie node -> {token: child}; node 0 is the root
    weight, token, parent, depth = [0.0], [-1], [-1], [0]
    for cont, w in zip(continuations, weights):
        node = 0
        for t in cont:
            nxt = kids[node].get(t)
            if nxt is None:
                nxt = len(kids)
                kids[node][t] = nxt
                kids.append({})
                weight.append(0.0)
                token.append(t)
                parent.append(node)
                depth.append(depth[node] + 1)
            weight[nxt] += w
            node = nxt
    total = sum(weights)
    out = Tree([], [])
    index = {0: -1}                              # trie node -> proposal index
    # ties: the shallower node (a shorter guess is the safer one), then the earlier-inserted (more recent)
    heap = [(-weight[c], 1, c) for c in kids[0].values()]
    heapq.heapify(heap)
    while heap and len(out.tokens) < budget:
        neg_w, _, c = heapq.heappop(heap)
        if -neg_w < min_share * total:
            break
        index[c] = len(out.tokens)
        out.tokens.append(token[c])
        out.parents.append(index[parent[c]])
        for g in kids[c].values():
            heapq.heappush(heap, (-weight[g], depth[g], g))
    return out


class SuffixStore:
    """Engine-lifetime n-gram indexes: the corpus (static) and the requests served (history)."""

    def __init__(self, n_min: int, n_max: int, corpus_docs: list[list[int]]):
        self.n_min, self.n_max = n_min, n_max
        self.corpus: NgramIndex | None = None
        if corpus_docs:
            self.corpus = NgramIndex(n_min, n_max, MAX_OCCURRENCES)
            for d in corpus_docs:
                self.corpus.extend(self.corpus.new_doc(), d)
        self.history = NgramIndex(n_min, n_max, MAX_OCCURRENCES)

    def forget(self) -> None:
        """Start the history afresh (running requests keep the index they hold)."""
        self.history = NgramIndex(self.n_min, self.n_max, MAX_OCCURRENCES)

    def history_for_new_request(self) -> NgramIndex:
        """The index a new request reads and writes; a full history is replaced (requests still running keep
        the old one until they finish)."""
        if self.history.size > HISTORY_TOKENS:
            self.history = NgramIndex(self.n_min, self.n_max, MAX_OCCURRENCES)
        return self.history


class SuffixProposer(ProposerBase):
    name = "suffix"
    samples = False
    bursty = True                # right for stretches while the output copies, wrong elsewhere
    cheap = True

    def __init__(self, store: SuffixStore, device: torch.device):
        self.corpus = store.corpus
        self.history = store.history_for_new_request()
        self.doc = self.history.new_doc()
        self.device = device

    def propose(self, ctx: ProposeContext) -> Proposal:
        toks = ctx.tokens
        indexed = len(self.history.docs[self.doc])
        if len(toks) > indexed:
            self.history.extend(self.doc, toks[indexed:])
        n, found = self._longest_match(toks)
        if not found:
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device), parents=[])
        matches = [index.context_match(occ, toks, n, MAX_MATCH) for index, occ in found]
        budget = min(ctx.k, NODES_PER_MATCHED_TOKEN * max(matches))
        conts = [index.continuation(occ, budget, live=index is self.history and index.doc_of(occ) == self.doc)
                 for index, occ in found]
        tree = frequency_tree(conts, [float(m) for m in matches], budget)
        return Proposal(torch.tensor(tree.tokens, dtype=torch.long, device=self.device), parents=tree.parents,
                        match=max(matches))

    def _longest_match(self, toks: list[int]) -> tuple[int, list[tuple[NgramIndex, int]]]:
        """(n, occurrences as (index, occurrence)) for the longest n-gram ending the context seen anywhere."""
        for n in range(min(self.history.n_max, len(toks) - 1), self.history.n_min - 1, -1):
            key = tuple(toks[-n:])
            hits = self.history.lookup(key)
            own = [(self.history, o) for o in reversed(hits) if NgramIndex.doc_of(o) == self.doc]
            others = [(self.history, o) for o in reversed(hits) if NgramIndex.doc_of(o) != self.doc]
            corpus = [(self.corpus, o) for o in reversed(self.corpus.lookup(key))] if self.corpus else []
            found = (own + others + corpus)[:MAX_OCCURRENCES]
            if found:
                return n, found
        return 0, []

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits=None) -> None:
        pass   # the history catches up with the committed tokens at the next propose


def load_corpus(path: str, tokenizer) -> list[list[int]]:
    """Token ids of a text file, or of every file under a directory (one document each, hidden files skipped)."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()
                                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
    docs = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if text:
            docs.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not docs:
        raise ConfigError("corpus", f"{path!r} holds no text")
    log.info("suffix corpus: %d documents, %d tokens from %s", len(docs), sum(map(len, docs)), path)
    return docs


@register("suffix")
def _build(spec: SpecConfig, target, draft):
    if not target.model.capabilities.trees:
        raise ConfigError("method", "suffix proposes trees, which this model's adapter cannot verify; "
                                    "use a native model family or --method ngram")
    docs = load_corpus(spec.corpus, target.tokenizer) if spec.corpus else []
    return SuffixFactory(SuffixStore(spec.ngram_min, spec.ngram_max, docs), target.model.device)


@dataclass
class SuffixFactory(ProposerFactory):
    """One proposer per request over the engine's store; forget() drops what earlier requests taught it."""
    store: SuffixStore
    device: torch.device

    def __call__(self, max_len: int, group=None) -> SuffixProposer:
        return SuffixProposer(self.store, self.device)

    def forget(self) -> None:
        self.store.forget()

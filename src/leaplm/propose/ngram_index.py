"""An incremental n-gram index over token documents: n-gram -> where the token after it was, most recent last.

Documents grow by `extend`; each new token costs one dict update per n in [n_min, n_max], so a proposer
keeps its index current in O(new tokens) per step, never O(context). Only n-grams whose following token
exists are indexed: the context's own last n tokens never match themselves.
"""
from __future__ import annotations

from typing import Sequence

_POS_BITS = 40      # an occurrence is one int: doc << _POS_BITS | position (small, hashable, no tuple)


class NgramIndex:
    def __init__(self, n_min: int, n_max: int, keep: int):
        self.n_min, self.n_max = n_min, n_max
        self.keep = keep                                   # occurrences remembered per n-gram
        self.docs: list[list[int]] = []
        self.table: dict[tuple[int, ...], list[int]] = {}   # n-gram -> occurrences, oldest first
        self.size = 0                                       # tokens indexed over all documents

    def new_doc(self) -> int:
        self.docs.append([])
        return len(self.docs) - 1

    def extend(self, doc: int, tokens: Sequence[int]) -> None:
        d = self.docs[doc]
        start = len(d)
        d.extend(tokens)
        self.size += len(tokens)
        table, keep = self.table, self.keep
        for i in range(max(start, self.n_min), len(d)):    # i: the follower's position
            occ = doc << _POS_BITS | i
            for n in range(self.n_min, min(self.n_max, i) + 1):
                key = tuple(d[i - n: i])
                hits = table.get(key)
                if hits is None:
                    table[key] = [occ]
                else:
                    hits.append(occ)
                    if len(hits) > keep:
                        del hits[0]

    def lookup(self, key: tuple[int, ...]) -> list[int]:
        """Occurrences of the n-gram `key`, oldest first (empty when unseen)."""
        return self.table.get(key, [])

    def continuation(self, occ: int, n: int, live: bool = False) -> list[int]:
        """Up to n tokens from occurrence `occ` on (the follower first).

        live: the document is the context being extended, so a continuation that runs into its end repeats
        the span between the match and the end (in a loop, what matching again after each token would give).
        """
        doc, pos = occ >> _POS_BITS, occ & ((1 << _POS_BITS) - 1)
        d = self.docs[doc]
        if not live or pos + n <= len(d):
            return d[pos: pos + n]
        period = len(d) - pos
        return [d[pos + j % period] for j in range(n)]

    def context_match(self, occ: int, tokens: Sequence[int], matched: int, limit: int) -> int:
        """How many tokens before occurrence `occ` equal the end of `tokens`, counting on from `matched`
        (already known to match) up to `limit`."""
        doc, pos = occ >> _POS_BITS, occ & ((1 << _POS_BITS) - 1)
        d = self.docs[doc]
        m = matched
        while m < limit and m < pos and m < len(tokens) and d[pos - m - 1] == tokens[-m - 1]:
            m += 1
        return m

    @staticmethod
    def doc_of(occ: int) -> int:
        return occ >> _POS_BITS

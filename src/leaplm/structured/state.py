"""A request's grammar state under speculation: the token mask at every verified position, forced tokens, rollback.

The state holds an llguidance matcher that has consumed exactly the request's committed output tokens. A step asks
it three things, none of which changes what it has consumed:

  forced(limit)      the tokens the grammar forces next from the committed state (a JSON key, `": "`, a closing
                     brace): drafts that cost no proposer. They are llguidance's canonical tokenization of the
                     forced bytes; another tokenization of the same bytes can be allowed too, so they are verified
                     like any draft (masked p agrees with them almost always)
  plan_chain(drafts) how many drafts the grammar allows in a row, and the mask [kept + 1, V] at each position of
                     the block [last token, kept drafts]: row j is what the grammar allows after the first j drafts
  plan_tree(...)     the same for a tree: the nodes kept (a forbidden node and everything under it pruned) and the
                     mask after the path to each

Each plan consumes the drafts tentatively and rolls them back before returning. After verification the step
advances the state by the tokens it committed (advance): the committed state and the target cache move together,
a rejected draft never reaches either. A position whose mask is empty would leave p without mass, so drafts are
cut before one; at the committed state itself an empty mask is a dead end (`dead_end`), and the request ends.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..cache.tree import children
from ..config import StructuredOutput

def unpack_bitmask(bm: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask [N, ceil(V / 32)] int32 (bit b of word w: token 32 w + b) -> allowed [N, V] bool.
    numpy unpacks bits in a few microseconds where the equivalent torch ops take tens (little-endian words)."""
    bits = np.unpackbits(bm.numpy().view(np.uint8), axis=-1, bitorder="little")          # [N, 32 * words]
    return torch.from_numpy(bits[:, :vocab_size].astype(bool))


def fill_mask(matcher, bm: torch.Tensor, j: int) -> None:
    """The mask after the matcher's state into row j of bm [N, words] int32 (CPU, contiguous): what
    llguidance.torch.fill_next_token_bitmask does, without importing llguidance.torch, whose import compiles a
    kernel with torch.compile (about a second holding the GIL: every request running meanwhile would stall).
    llguidance computes the mask without the GIL."""
    row = bm[j]                                                                           # [words]
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


class GrammarError(RuntimeError):
    """The request's grammar failed while it ran: llguidance refused a token, or a step went past its limits
    (lexer fuel, Earley items in a row: a grammar too wide or too ambiguous). The request's own fault: it ends."""


class GrammarVocab:
    """llguidance's view of a tokenizer (each token's bytes), built once per engine: about 0.1 s for 8k tokens,
    1 s for 49k. vocab_size is the model's (rows past the tokenizer's tokens are never allowed); eos_token_ids end
    a grammar that is complete (allowed exactly when the grammar accepts).

    Building a matcher for a large grammar takes up to seconds (llguidance drops the GIL meanwhile). The server
    builds one while it prepares the request, off the event loop, to refuse what llguidance rejects; the row that
    runs it later, in the scheduler's thread between steps, gets a copy of that one (the last BUILT grammars are
    kept), so no step waits for a compile."""

    BUILT = 8              # grammars whose fresh matcher is kept to copy from
    # llguidance's limits (its defaults otherwise: Earley items per row and per step, lexer fuel per step bound
    # each step's time): regex construction fuel a fifth of its default, so a pathological regex such as
    # (x{1000}){1000} is built lazily in about 20 MB and 0.05 s instead of 200 MB and 1.3 s; lexer states a fifth
    # (about 100 MB at most); errors without the grammar quoted (a 1 MB grammar would be, whole)
    LIMITS = {"initial_lexer_fuel": 200_000, "max_lexer_states": 50_000, "verbose_errors": False}

    @classmethod
    def limits(cls):
        import llguidance as llg

        return llg.LLParserLimits(**cls.LIMITS)

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        import copy

        import llguidance as llg

        self.vocab_size = vocab_size
        self.eos = frozenset(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._built: OrderedDict[str, object] = OrderedDict()     # grammar text -> a matcher that consumed nothing
        self._built_lock = threading.Lock()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured output needs a fast (Rust) tokenizer; this one is "
                             f"{type(tokenizer).__name__}")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        self.phantom = None
        eos = sorted(self.eos)
        if not eos:
            # llguidance needs an end-of-sequence id (without one it takes id 0): a special token of our own, never
            # allowed in a mask the step reads
            backend.add_special_tokens(["<|leaplm-grammar-end|>"])
            self.phantom = backend.get_vocab_size(with_added_tokens=True) - 1
            eos = [self.phantom]
        self.ll_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        try:
            self.lltok = llg.LLTokenizer(backend.to_str(), n_vocab=self.ll_vocab, eos_token=eos)
        except (ValueError, TypeError) as e:
            raise ValueError(f"llguidance cannot read this tokenizer: {e}") from None

    def state(self, spec: StructuredOutput) -> "GrammarState":
        matcher, forced_ok, first_mask = self._fresh(spec.compiled)
        if matcher.is_error():
            raise ValueError(f"grammar rejected by llguidance: {matcher.get_error()[:500]}")
        return GrammarState(matcher, self.vocab_size, self.eos, self.ll_vocab, self.phantom, forced_ok=forced_ok,
                            first_mask=first_mask)

    def _fresh(self, grammar: str):
        """(a matcher that has consumed nothing: a copy of a kept one, else built (and kept when valid), whether
        its forced tokens are within GrammarState.FORCED_BUDGET_S: timed once, on a copy, when it is built, and
        its first mask [words] int32, computed when it is built: a copy computes its own again, which takes
        20 ms for (x{1000}){1000})."""
        import llguidance as llg

        lock, built = self._built_lock, self._built
        with lock:
            kept = built.get(grammar)
            if kept is not None:
                built.move_to_end(grammar)
                return kept[0].deep_copy(), kept[1], kept[2]
        matcher = llg.LLMatcher(self.lltok, grammar, log_level=0, limits=self.limits())
        first_mask = None
        if not matcher.is_error():
            bits = matcher.compute_bitmask()    # a grammar too wide for the limits at its first token fails here
            first_mask = torch.frombuffer(bytearray(bits), dtype=torch.int32)                    # [words]
        if matcher.is_error():
            return matcher, False, None
        probe = matcher.deep_copy()
        t = time.perf_counter()
        probe.compute_ff_tokens()
        forced_ok = time.perf_counter() - t <= GrammarState.FORCED_BUDGET_S
        with lock:
            built[grammar] = (matcher, forced_ok, first_mask)
            while len(built) > self.BUILT:
                built.popitem(last=False)
            return matcher.deep_copy(), forced_ok, first_mask


@dataclass
class TreePlan:
    kept: list[int]          # indices of the tree nodes kept, in proposal (topological) order
    masks: torch.Tensor      # [1 + len(kept), V] bool: row 0 the root, row j + 1 after the path to kept[j]


class GrammarState:
    """One request's matcher; see the module docstring. Not thread-safe (one step at a time owns it).

    Forced tokens are a saving, never needed: llguidance computes them holding the GIL (tens of milliseconds for a
    pathological grammar such as (x{1000}){1000}, when every thread of the server, the event loop's included, would
    wait), so a grammar whose forced tokens took more than FORCED_BUDGET_S once (when it was built, or at any step)
    drafts none from then on; its drafts come from the row's proposer, verified the same way.

    The mask before the first output token is the grammar's alone: given as first_mask (computed once when the
    grammar was built), it is not computed again."""

    FORCED_BUDGET_S = 0.002

    def __init__(self, matcher, vocab_size: int, eos: frozenset[int] = frozenset(), ll_vocab: int | None = None,
                 phantom: int | None = None, forced_ok: bool = True, first_mask: torch.Tensor | None = None):
        self.m = matcher
        self.forced_ok = forced_ok                           # forced tokens within FORCED_BUDGET_S so far
        self.vocab_size = vocab_size
        self.eos = eos                                       # end-of-sequence ids: consumed, they stop the grammar
        self._eos_only = torch.zeros(vocab_size, dtype=torch.bool)                  # [V]: the mask after one
        self._eos_only[sorted(eos)] = True
        self.phantom = phantom if phantom is not None and phantom < vocab_size else None   # masked out
        self.committed = 0                                   # output tokens consumed
        self._bm = torch.full((1, ((ll_vocab or vocab_size) + 31) // 32), -1, dtype=torch.int32)  # [rows, words]
        words = self._bm.shape[1]           # llguidance's own bitmask may have a word more (its vocabulary + 1 bits)
        fits = first_mask is not None and first_mask.numel() >= words
        self.first_mask = first_mask[:words] if fits else None   # [words] int32: the mask before any output token

    # --- queries at the committed state --------------------------------------------------------------------------
    def allowed(self) -> torch.Tensor:
        """The mask [V] bool of the next token."""
        return self._masks_along([], 0)[0]

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more (only an end-of-sequence token, where there is one)."""
        return self.m.is_stopped()

    @property
    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None

    def forced(self, limit: int) -> list[int]:
        """At most `limit` tokens the grammar forces next (may be empty; always empty once they took more than
        FORCED_BUDGET_S)."""
        if limit <= 0 or not self.forced_ok or self.m.is_stopped():
            return []
        t = time.perf_counter()
        toks = self.m.compute_ff_tokens()
        self.forced_ok = time.perf_counter() - t <= self.FORCED_BUDGET_S
        return toks[:limit]

    # --- tentative plans ----------------------------------------------------------------------------------------
    def plan_chain(self, drafts: list[int], keep_forbidden: bool = False) -> tuple[int, torch.Tensor]:
        """(n, masks [n + 1, V] bool): the first n drafts to score and the mask at each position of the block.
        drafts[:n] are allowed one after another, except with keep_forbidden, where the first forbidden draft is
        kept as the last one (a sampled draft, verified by rejection sampling: rejected with probability 1, its
        residual is what plain decoding's distribution needs; cutting it would bias the output). A row no token
        of the grammar reaches (after a forbidden draft, or a grammar completed without an end-of-sequence token)
        allows everything: nothing sampled there is kept (commit stops at the grammar's end)."""
        n = self.m.validate_tokens(drafts) if drafts else 0
        n = next((j + 1 for j, t in enumerate(drafts[:n]) if t in self.eos), n)   # nothing follows an EOS
        masks = self._masks_along(drafts, n)
        if keep_forbidden and n < len(drafts) and (n == 0 or drafts[n - 1] not in self.eos):
            masks = torch.cat([masks, torch.ones_like(masks[:1])])
            n += 1
        empty = ~masks[1:].any(-1)
        masks[1:][empty] = True
        return n, masks

    def plan_tree(self, tokens: list[int], parents: list[int], keep_forbidden: bool = False) -> TreePlan:
        """The nodes of a tree (tokens [K], parents [K], -1 = the root) to score, and their masks: a forbidden node
        and everything under it pruned, or with keep_forbidden (sampled nodes) the forbidden node kept as a leaf
        (see plan_chain)."""
        kids = children(parents)
        rows: dict[int, torch.Tensor] = {}                    # -1 (root) or node -> mask after its path
        anything = torch.ones(self.vocab_size, dtype=torch.bool)

        def visit(node: int, depth: int) -> None:             # the matcher has consumed the path to node
            mask = self._masks_along([], 0, tentative=depth)[0]
            rows[node] = mask if node < 0 or bool(mask.any()) else anything
            for c in kids[node + 1]:
                t = tokens[c]
                if not (0 <= t < self.vocab_size and bool(mask[t])):
                    if keep_forbidden:
                        rows[c] = anything                    # a leaf: never accepted, its row never read
                    continue
                if t in self.eos:                             # nothing follows an end-of-sequence token
                    rows[c] = self._eos_only
                else:
                    if not self.m.consume_token(t):
                        raise GrammarError(f"llguidance refused an allowed token: {self.m.get_error()}")
                    visit(c, depth + 1)
                    self._rollback(1)

        visit(-1, 0)
        kept = sorted(k for k in rows if k >= 0)
        return TreePlan(kept, torch.stack([rows[-1]] + [rows[k] for k in kept]))

    # --- commit ------------------------------------------------------------------------------------------------
    def advance(self, tokens: list[int]) -> int:
        """Consume committed tokens (each allowed by the mask it was verified under) up to the grammar's end;
        returns how many it took (the tokens after a completed grammar are not part of the output)."""
        for i, t in enumerate(tokens):
            if self.m.is_stopped():
                return i
            if not self.m.consume_token(t):
                raise GrammarError(f"token {t} refused by the grammar: {self.m.get_error()}")
            self.committed += 1
        return len(tokens)

    # --- internals ------------------------------------------------------------------------------------------------
    def _masks_along(self, drafts: list[int], n: int, tentative: int = 0) -> torch.Tensor:
        """Masks [n + 1, V] after drafts[:j] for j = 0..n (drafts[:n] allowed, an EOS only as the last); the
        matcher is left as it was. tentative: tokens the matcher has consumed past the committed ones."""
        if self._bm.shape[0] < n + 1:
            self._bm = torch.full((n + 1, self._bm.shape[1]), -1, dtype=torch.int32)
        bm = self._bm[: n + 1]
        eos_last = n > 0 and drafts[n - 1] in self.eos
        fed = n - 1 if eos_last else n
        for j in range(fed + 1):
            if j == 0 and self.committed + tentative == 0 and self.first_mask is not None:
                self._bm[0] = self.first_mask
            else:
                fill_mask(self.m, self._bm, j)
            if j < fed and not self.m.consume_token(drafts[j]):
                raise GrammarError(f"llguidance refused a validated token: {self.m.get_error()}")
        self._rollback(fed)
        masks = unpack_bitmask(bm, self.vocab_size)                                 # [n + 1, V]
        if self.phantom is not None:
            masks[:, self.phantom] = False
        if eos_last:
            masks[n] = self._eos_only
        return masks

    def _rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise GrammarError(f"grammar rollback of {n} tokens failed: {self.m.get_error()}")

"""A smaller model with the same tokenizer drafts K tokens autoregressively over its own KV cache.

Batching: the draft proposers of one batch share a `DraftRows` group, one draft KV cache whose slots [0, m) belong
to its m live proposers. The step calls `DraftRows.propose_rows` once for all the rows that draft: one draft
forward per draft position over [m, T] instead of one per row (a proposer used alone is a group of one). A slot
is the proposer's for its lifetime; when one is released the last slot moves into its place.

Cache bookkeeping per slot: before proposing, the draft feeds the committed tokens it has not seen (at least the
last one); while drafting it feeds d_1..d_{K-1}. After verification it keeps the committed prefix it has cached:
len(tokens) + min(accepted, K - 1) entries, so nothing is ever recomputed or copied. A long catch-up (a new row's
prompt) is prefilled alone first, so the batched forward's padding stays short; padding after a row's real tokens
is harmless (causal attention, and the slots past a row's length are overwritten later).

Vocabulary: a draft whose embedding is padded past the tokenizer (or the target's, the other way round) drafts
over the tokenizer's real tokens only: its padded rows are masked and its logits cut or padded to the target's
size, so q and p index the same tokens (engine.check_vocab has checked that the tokenizers agree).

Placement: the draft may sit on another device than the target (--draft-device). Its logits move to the
target's device (out_device) as soon as they are computed, so the logits processors, the request's generator
and the returned proposal all live where the verifier runs; only the token ids fed to the draft cross back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..verify import VerifyResult
from .base import Guesses, Proposal, ProposeContext, ProposerBase, ProposerFactory

CATCHUP_IN_BATCH = 4      # unseen tokens a row feeds inside the batched forward; more are prefilled alone first


class DraftRows:
    """The draft KV cache of the draft proposers of one batch (see the module docstring)."""

    def __init__(self, model, max_rows: int, max_len: int, out_device=None, vocab_size: int | None = None,
                 real_tokens: int | None = None):
        self.model = model                       # CausalLM, shared by all requests
        self.vocab_size = vocab_size or model.vocab_size     # the target's rows: q must have as many
        self.real_tokens = real_tokens           # tokens the tokenizer has (rows past it are padding)
        self.out_device = out_device if out_device is not None else model.device   # the target's device
        self.max_len = max_len
        self.cache = model.new_cache(max_rows, max_len)
        self.owners: list[DraftModelProposer] = []          # owners[s] holds slot s
        self.batched = max_rows > 1 and model.capabilities.batch

    def fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, V_draft] -> [n, V_target], padded rows at -inf (a no-op when the sizes agree)."""
        Vd, Vt = logits.shape[-1], self.vocab_size
        if Vd == Vt:
            return logits
        real = min(self.real_tokens or min(Vd, Vt), Vd, Vt)
        out = logits.new_full((logits.shape[0], Vt), float("-inf"))
        out[:, :real] = logits[:, :real]
        return out

    # --- slots ---------------------------------------------------------------------------------------------------
    def take_slot(self, proposer: "DraftModelProposer") -> int:
        if len(self.owners) >= self.cache.batch_size:
            raise RuntimeError(f"all {self.cache.batch_size} draft rows are in use")
        self.owners.append(proposer)
        self.cache.truncate(0, len(self.owners) - 1)
        return len(self.owners) - 1

    def release(self, proposer: "DraftModelProposer") -> None:
        """Free proposer's slot, keeping slots [0, m) dense."""
        s, last = proposer.slot, len(self.owners) - 1
        if s < 0 or s > last or self.owners[s] is not proposer:
            return
        if s != last:
            self.cache.move_row(last, s)
            self.owners[s] = self.owners[last]
            self.owners[s].slot = s
        self.owners.pop()
        self.cache.truncate(0, last)
        proposer.slot = -1

    def _view(self, s: int):
        return self.cache if self.cache.batch_size == 1 else self.cache.row_view(s)

    # --- proposing -----------------------------------------------------------------------------------------------
    def propose_rows(self, proposers: list["DraftModelProposer"],
                     ctxs: list[ProposeContext]) -> list[Proposal]:
        """Each proposer's chain of up to its ctx.k tokens; one draft forward per draft position for all of them
        when the model runs batches, else row by row."""
        if not self.batched or len(proposers) == 1:
            return [self._propose_rows([p], [c])[0] for p, c in zip(proposers, ctxs)]
        return self._propose_rows(proposers, ctxs)

    def _propose_rows(self, proposers: list["DraftModelProposer"], ctxs: list[ProposeContext]) -> list[Proposal]:
        cache, dev = self.cache, self.model.device
        feeds, ks, catchup = [], [], []
        for p, ctx in zip(proposers, ctxs):
            toks = ctx.tokens
            cached = min(p.cached, len(toks) - 1)           # the last token is always fed: its logits draft
            cache.lengths[p.slot] = cached
            t = time.perf_counter()
            if len(toks) - cached > CATCHUP_IN_BATCH:       # a long catch-up: prefill it alone, keep the last few
                upto = len(toks) - CATCHUP_IN_BATCH
                view = self._view(p.slot)
                self.model(torch.tensor([toks[cached:upto]], device=dev), view, last_only=True)
                cache.lengths[p.slot] = cached = upto
            catchup.append(time.perf_counter() - t)
            feeds.append(toks[cached:])
            ks.append(max(1, min(ctx.k, self.max_len - len(toks) - 1)))
        if len(proposers) == 1 and self._plain_greedy(ctxs[0]):
            chain = self.model.greedy_chain(feeds[0], ks[0], self._view(proposers[0].slot), self._real())
            if chain is not None:                    # the k drafts in one call: no Python between the forwards
                return [self._done(proposers[0], ctxs[0], ks[0], chain, None, catchup[0])]
        # one forward over slots [0, hi): the drafting slots in place, the others fed padding past their length
        slots = [p.slot for p in proposers]
        hi = max(slots) + 1 if len(proposers) > 1 else None
        drafts = [[] for _ in proposers]
        qs = [[] for _ in proposers]
        presence = [c.presence.clone() if c.presence is not None else None for c in ctxs]   # [V] each
        cur = feeds
        for i in range(max(ks)):
            active = [j for j in range(len(proposers)) if i < ks[j]]
            logits = self.fit_vocab(self._forward([slots[j] for j in active], [cur[j] for j in active], hi))  # [n, V]
            for a, j in enumerate(active):
                ctx, row_logits = ctxs[j], logits[a: a + 1].to(self.out_device)              # [1, V]
                pres = presence[j].unsqueeze(0) if presence[j] is not None else None
                if ctx.generator is None:
                    t = int(ctx.processor.greedy(row_logits, pres))
                else:
                    q = ctx.processor.probs(row_logits, pres)                                # [1, V]
                    t = ctx.sample_chain(q, i)
                    if ctx.wants_q:                  # only rejection sampling reads q
                        qs[j].append(q[0])
                drafts[j].append(t)
                if presence[j] is not None:
                    presence[j][t] = True
            cur = [[d[-1]] if d else [] for d in drafts]
        return [self._done(p, ctx, ks[j], drafts[j], torch.stack(qs[j]) if qs[j] else None, catchup[j])
                for j, (p, ctx) in enumerate(zip(proposers, ctxs))]

    def _done(self, p: "DraftModelProposer", ctx: ProposeContext, k: int, drafts: list[int],
              q: torch.Tensor | None, catchup_s: float) -> Proposal:
        """Slot p's proposal of `drafts` (q [k, V] when the verifier reads it); the slot now holds the context and
        d_1..d_{k-1}."""
        p.n_ctx, p.k = len(ctx.tokens), k
        p.cached = p.n_ctx                     # every committed token seen (observe adds accepted drafts)
        self.cache.lengths[p.slot] = p.n_ctx + k - 1
        return Proposal(torch.tensor(drafts, device=self.out_device), q, catchup_s=catchup_s)

    def _plain_greedy(self, ctx: ProposeContext) -> bool:
        """A row whose drafts are the argmax of the draft's logits over the real tokens (processor.greedy without
        a penalty), which the model may draft in one call."""
        return (self.model.capabilities.greedy_chain and ctx.generator is None and not ctx.wants_q
                and (ctx.presence is None or ctx.params.repetition_penalty == 1.0))

    def _real(self) -> int:
        """Rows of the draft's logits a draft token may be (fit_vocab's: the others are -inf or cut)."""
        Vd, Vt = self.model.vocab_size, self.vocab_size
        return Vd if Vd == Vt else min(self.real_tokens or min(Vd, Vt), Vd, Vt)

    def guesses(self, p: "DraftModelProposer", tokens: list[int], first: int = 0) -> Guesses | None:
        """Slot p's catching up on committed tokens, every position's logits kept from the guess of tokens[first]
        on: tokens[p.cached: -1] fed, those before first - 1 in a forward that keeps no logits (a prompt's: on the
        embedded draft the output layer over a 100-token prompt cost more than the rest of the forward, 5-8% of
        a short constrained request); logits [m, V], row j the draft's guess of tokens[start + j + 1] (the last
        token is fed by the next proposal, whose first draft it opens)."""
        start, end = min(p.cached, len(tokens) - 1), len(tokens) - 1
        if end <= start:
            return None
        dev = self.model.device
        self.cache.lengths[p.slot] = start
        skip = min(max(start, first - 1), end)
        if skip > start:                                  # fed only: no guess of these is asked for
            self.model(torch.tensor([tokens[start:skip]], device=dev), self._view(p.slot), last_only=True)
            self.cache.lengths[p.slot] = skip
        p.cached = skip
        if end <= skip:
            return None
        # a row view is taken after the lengths are set: some caches' views read the row's length when made
        logits = self.model(torch.tensor([tokens[skip:end]], device=dev), self._view(p.slot))      # [1, m, V]
        self.cache.lengths[p.slot] = end
        p.cached = end
        return Guesses(skip, self.fit_vocab(logits[0]).to(self.out_device))

    def _forward(self, slots: list[int], feeds: list[list[int]], hi: int | None) -> torch.Tensor:
        """Logits [len(slots), V] at each slot's last fed token; the slots' lengths advance by what they were fed.
        hi None: one slot through its own view. Otherwise one forward over slots [0, hi), the rows right-padded to
        the longest feed; a slot that does not draft gets padding only."""
        cache, dev = self.cache, self.model.device
        if hi is None or len(slots) == 1:
            s, f = slots[0], feeds[0]
            view = self._view(s)
            logits = self.model(torch.tensor([f], device=dev), view, last_only=True)[:, -1]   # [1, V]
            cache.lengths[s] += len(f)
            return logits
        T = max(len(f) for f in feeds)
        if max(cache.lengths[:hi]) + T > self.max_len:       # a slot near its end: no room for padding
            return torch.cat([self._forward([s], [f], None) for s, f in zip(slots, feeds)])
        block = torch.zeros(hi, T, dtype=torch.long)                                          # [hi, T]
        for s, f in zip(slots, feeds):
            block[s, : len(f)] = torch.tensor(f)
        logits = self.model(block.to(dev), cache)                                             # [hi, T, V]
        idx = torch.tensor([len(f) - 1 for f in feeds], device=logits.device)
        out = logits[torch.tensor(slots, device=logits.device), idx]                          # [n, V]
        for s, f in zip(slots, feeds):
            cache.lengths[s] += len(f)
        return out


@dataclass
class DraftModelFactory(ProposerFactory):
    """method 'draft': builds one proposer per request; proposers of one batch share a DraftRows group."""
    model: object                                # the draft CausalLM
    out_device: object = None                    # the target's device
    vocab_size: int | None = None                # the target's vocabulary rows (None: the draft's)
    real_tokens: int | None = None               # the shared tokenizer's tokens (rows past it are padding)

    def new_group(self, max_rows: int, max_len: int) -> DraftRows:
        return DraftRows(self.model, max_rows, max_len, self.out_device, self.vocab_size, self.real_tokens)

    def __call__(self, max_len: int, group: DraftRows | None = None) -> "DraftModelProposer":
        return DraftModelProposer(self.model, max_len, self.out_device,
                                  group if group is not None else self.new_group(1, max_len))


class DraftModelProposer(ProposerBase):
    name = "draft"
    samples = True
    shadows = True

    def __init__(self, model, max_len: int, out_device=None, group: DraftRows | None = None):
        self.group = group if group is not None else DraftRows(model, 1, max_len, out_device)
        self.slot = self.group.take_slot(self)
        self.cached = 0                          # committed tokens held in the slot
        self.n_ctx = 0                           # len(tokens) at the last proposal
        self.k = 0

    @property
    def model(self):
        return self.group.model

    def propose(self, ctx: ProposeContext) -> Proposal:
        """This row alone (the step drafts for a whole group through DraftRows.propose_rows)."""
        return self.group.propose_rows([self], [ctx])[0]

    def lag(self, n_tokens: int) -> int:
        """Committed tokens the draft has not cached yet: what its next proposal must prefill first."""
        return max(0, n_tokens - self.cached)

    def guesses(self, tokens: list[int], first: int = 0) -> Guesses | None:
        """Teacher-forced guesses on the committed tokens not seen yet (DraftRows.guesses)."""
        return self.group.guesses(self, tokens, first)

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits=None) -> None:
        self.cached = self.n_ctx + min(result.accepted, self.k - 1)

    def close(self) -> None:
        """The request left: free the slot."""
        self.group.release(self)

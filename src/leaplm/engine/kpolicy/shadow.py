"""Evidence at K = 0: while a row decodes plainly, whether its proposer would have been right.

At K = 0 nothing is drafted, so nothing is verified, and an acceptance estimate that a few early misses pushed
below break-even would stay there (only rare probes could move it). Instead the policy keeps scoring the proposer
against the tokens the target commits anyway:

  cheap proposers (n-gram, suffix) propose at every step before K is chosen; at K = 0 the proposal is kept and
           compared with the tokens committed after it: its accepted length is the run of tokens that agree
  a draft model (Proposer.shadows) catches up on the committed tokens every SHADOW_CHUNK steps in one forward
           that keeps every position's logits: its guess of each committed token given the committed tokens
           before it (teacher-forced). A chain proposal starting at position t would have kept the run of
           consecutive right guesses from t: a right guess is fed back as the committed token itself, so the
           guesses after it are the same teacher-forced ones. Greedy: a guess is right when its argmax is the
           committed token; the race (seeded requests): when its race sample at that position (the same
           exponentials the target's sample used) is; rejection sampling: with probability sum min(p, q) over the
           target's p at that position (its top PROBS_TOP tokens, kept at each plain step)

Either way the outcome of a would-be proposal of the row's K drafts feeds the row's estimate and its method's as
a drafting step would (AcceptanceEstimate.observe_expected), so a row whose proposer starts hitting returns to
speculation within a few steps. The draft's forward is the catching up a later proposal would pay anyway (a
chunk of 8 tokens costs about what one token does); its seconds are counted in the request's shadow_s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...sampling.positional import ranked

SHADOW_CHUNK = 8        # committed tokens a draft model catches up on at once at K = 0
# A draft model's long catching up at K = 0 (a new row's prompt; every scoring of a constrained row) waits until it
# fits, with the evidence's seconds so far, within this share of its row's decoding so far and of the plain steps
# its request has left
SHADOW_BUDGET = 0.015
# All of a draft model's evidence at K = 0 (its scorings, and under rejection sampling the target's top tokens kept
# at every plain step: a softmax over SmolLM2's 49k vocabulary costs several percent of its 4.5 ms step) at most
# this share of its row's decoding so far
SHADOW_SHARE = 0.03
PROBS_TOP = 32          # the target's top tokens kept per plain step for rejection sampling's sum min(p, q)
MAX_PENDING = 16        # cheap proposals at K = 0 awaiting the tokens they are compared with


@dataclass
class Pending:
    """A cheap proposer's proposal made at K = 0: tokens[j] would have been the token at index start + j."""
    start: int
    tokens: list[int]
    match: int | None


@dataclass
class ShadowState:
    """One row's evidence at K = 0 not yet counted."""
    pending: list[Pending] = field(default_factory=list)      # cheap proposals awaiting their tokens
    # a draft model: for committed token index t, the probability that its teacher-forced guess was right
    right: dict[int, float] = field(default_factory=dict)
    counted: int = -1                                         # token indexes <= this have been counted
    probs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # t -> ([top] ids, [top] p)
    seconds: float = 0.0                                      # spent scoring guesses (the draft's forwards)


def keep_cheap(state: ShadowState, start: int, tokens: list[int], match: int | None) -> None:
    """Keep a proposal made at K = 0, cut to MAX_PENDING tokens: at K = 0 a token is committed per step, so a
    proposal that long is resolved before MAX_PENDING later ones push it out. A longer one that is right
    throughout (a prediction's 32 tokens) would be pushed out unresolved while the ones that miss early are
    counted, and the evidence would say only misses."""
    state.pending.append(Pending(start, tokens[:MAX_PENDING], match))
    del state.pending[:-MAX_PENDING]


def resolve_cheap(state: ShadowState, committed: list[int]) -> list[tuple[list[float], int | None]]:
    """Proposals whose outcome the committed tokens now tell (a disagreeing token, or all their tokens in):
    [(passed, match)] with passed[i] 1.0 while the first i + 1 agreed, else 0.0."""
    out, keep = [], []
    for p in state.pending:
        known = len(committed) - p.start
        run = 0
        while run < min(len(p.tokens), known) and committed[p.start + run] == p.tokens[run]:
            run += 1
        if run < min(len(p.tokens), known) or known >= len(p.tokens):
            out.append(([1.0] * run + [0.0] * (len(p.tokens) - run), p.match))
        else:
            keep.append(p)
    state.pending = keep
    return out


def keep_probs(state: ShadowState, t: int, p: torch.Tensor) -> None:
    """The target's p [V] at committed token index t (rejection sampling's rows)."""
    top = p.topk(min(PROBS_TOP, p.numel()))
    state.probs[t] = (top.indices, top.values)


def score_guesses(state: ShadowState, proposer, req, proc, verifier: str) -> None:
    """A draft model catches up on the committed tokens it has not seen, scoring each guess (module docstring)."""
    t0 = time.perf_counter()
    first = len(req.prompt_ids)            # guesses of the prompt's own tokens say little about the output's
    g = proposer.guesses(req.tokens, first)
    if g is not None:
        targets = req.tokens[g.start + 1: g.start + 1 + g.logits.shape[0]]
        if verifier == "greedy":
            right = (proc.greedy(g.logits) == torch.tensor(targets, device=g.logits.device)).tolist()
            for j, ok in enumerate(right):
                if g.start + 1 + j >= first:
                    state.right[g.start + 1 + j] = 1.0 if ok else 0.0
        else:
            q = proc.probs(g.logits)                                                   # [m, V]
            for j, tok in enumerate(targets):
                t = g.start + 1 + j
                if t < first:
                    continue
                if verifier == "race":
                    state.right[t] = 1.0 if ranked(q[j], req.seed, t, 1)[0] == tok else 0.0
                elif t in state.probs:
                    ids, p = state.probs[t]
                    state.right[t] = float(torch.minimum(p, q[j][ids]).sum())
        state.probs = {t: v for t, v in state.probs.items() if t > g.start + len(targets)}
    state.seconds += time.perf_counter() - t0


def resolve_guesses(state: ShadowState, cap: int) -> list[list[float]]:
    """Would-be proposals of `cap` drafts starting at each scored token index whose outcome is known (a wrong guess
    in its window, or its whole window scored): [passed] each, passed[i] the probability that its first i + 1
    drafts were kept. The scored indexes are contiguous (forget() clears them when the row drafts)."""
    out = []
    for t in sorted(t for t in state.right if t > state.counted):
        passed, prob = [], 1.0
        for j in range(cap):
            a = state.right.get(t + j)
            if a is None:
                break
            prob *= a
            passed.append(prob)
        if len(passed) < cap and prob > 0.0:
            break                                      # its window is not scored yet
        out.append(passed + [0.0] * (cap - len(passed)))
        state.counted = t
    for t in [t for t in state.right if t <= state.counted - cap]:
        del state.right[t]
    return out


def forget(state: ShadowState) -> None:
    """The row drafted: guesses scored before are not followed by the ones after (the draft skipped ahead)."""
    state.right.clear()
    state.probs.clear()
    state.counted = -1


def gather(r, d, asked: int, early, estimates) -> None:
    """Row r's evidence after a step (d: what it did; asked: its drafts asked; early: its cheap proposal made
    before K was chosen, None: none): a cheap proposal at K = 0 kept and compared with the tokens that follow, a
    draft model's guesses scored every SHADOW_CHUNK tokens; what is now known counted as drafting would be."""
    st, req, method, bursty = r.shadow, r.req, r.req.stats.method, r.proposer.bursty
    if d.drafted:
        forget(st)
    plain = not asked and not d.drafted
    if plain and early is not None:
        keep_cheap(st, len(req.tokens) - 1, early.tokens.tolist(), early.match)
    evidence = resolve_cheap(st, req.tokens) if st.pending else []
    if plain and r.proposer.shadows and r.cap > 0 and st.seconds > SHADOW_SHARE * req.stats.decode_s:
        # past its share of the row's decoding, a step gathers nothing; what was scored and not yet counted is
        # dropped, so the scored positions stay contiguous when it resumes
        forget(st)
    elif plain and r.proposer.shadows and r.cap > 0:
        if req.verifier == "rejection" and d.logits is not None:
            t0 = time.perf_counter()
            keep_probs(st, len(req.tokens) - 1, r.proc.probs(d.logits[-1:])[0])
            dt = time.perf_counter() - t0
            st.seconds += dt
            req.stats.shadow_s += dt
            req.stats.decode_s += dt
        lag = r.proposer.lag(len(req.tokens))
        # a long catching up (a prompt) waits until it fits, with the evidence's seconds so far, within
        # SHADOW_BUDGET of the row's decoding so far, and within that share of what the request has left; a
        # constrained row keeps every scoring within that share (its grammar's forced tokens fill a chunk of
        # guesses in a few steps, so its scorings come several times as often per plain step)
        now = lag * estimates.draft_prefill_s_per_token if lag > 2 * SHADOW_CHUNK else 0.0
        affordable = (lag <= 2 * SHADOW_CHUNK and req.grammar is None) or (
            st.seconds + now <= SHADOW_BUDGET * req.stats.decode_s
            and now <= SHADOW_BUDGET * tokens_left(req) * estimates.costs.cost(1, 1))
        # not on a row's first step: like its drafts, its catching up waits until the first token is out
        if lag > SHADOW_CHUNK and affordable and req.stats.target_forwards > 1:
            before = st.seconds
            score_guesses(st, r.proposer, req, r.proc, req.verifier)
            req.stats.shadow_s += st.seconds - before
            req.stats.decode_s += st.seconds - before
        evidence += [(passed, None) for passed in resolve_guesses(st, r.cap)]
    for passed, match in evidence:
        r.acceptance.observe_expected(passed, match)
        estimates.observe_expected(method, passed, match, bursty, r.band)


def tokens_left(req) -> int:
    """The tokens a request is expected to have left, what a draft model's catching up paid at once is weighed
    against: its budget (max_new_tokens less its output), or for a constrained request at most as many as it has
    produced so far. A grammar usually ends its request long before the budget (13-74 tokens of 96 on the
    structured workloads), and weighed against the budget a short constrained request fed its prompt to the draft
    for evidence and explorations that its few remaining steps could not repay."""
    if req.grammar is None:
        return req.remaining
    return max(1, min(req.remaining, len(req.tokens) - len(req.prompt_ids)))

"""Predicted Outputs: draft the request's prediction (text the output is expected to repeat: the file an edit
rewrites, the paragraph a proofreading returns) from where the output agrees with it, ahead of the request's own
proposer. Deterministic (q = None): the prediction's tokens are verified like any draft, so the output is the
target's whatever the prediction says.

Alignment is kept in characters of the prediction's text P (its tokens decoded, so P and the output's text are
written the same way):

  follow    while the output's new text continues P at the aligned offset c, c moves past it (a whitespace run
            matches any whitespace run: an answer may wrap lines elsewhere)
  depart    the first character that differs (an inserted line, a renamed word, a deleted sentence) loses the
            alignment; the last aligned offset is remembered
  realign   the output's last TAILS characters are looked up in P (whitespace runs as one space), the first occurrence at or after the last
            aligned offset first (a rename early in a file does not lose the rest), else the nearest one before it
            (for tails of at least MIN_BEHIND characters: a short tail behind is more often chance than a repeat)
  draft     from c: where c is a boundary of P's tokens, the prediction's own ids from there; where it is not (the
            output's tokens split the text elsewhere, or the output ended inside one of P's tokens), the text up to
            P's next boundary tokenized afresh, then P's ids from that boundary on

The proposal's `match` is the number of output tokens that lie inside the agreement just before c, so the K
policy keeps acceptance per agreement length: a long agreement earns long blocks (a row with a prediction may
draft up to PREDICTION_K tokens a step, the policy choosing K from the measured cost of each block length), a
fresh or short one short blocks or none.

Composition: `PredictedProposer` wraps the request's own proposer (None for method `none`) and drafts the
prediction first, the inner proposer's proposal (at most its own K) where the prediction has nothing to say.
Proposers that draft in a group (the draft model) keep drafting together through `PredictedGroup`.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import torch

from ..config import ConfigError
from ..verify import VerifyResult
from .base import Proposal, ProposeContext, Proposer, ProposerBase, ProposerGroup

PREDICTION_K = 32        # the most tokens a row with a prediction drafts a step (the K policy chooses below it)
TAILS = (32, 16, 8, 4)   # output tail lengths (characters) looked up in the prediction to realign, longest first
MIN_BEHIND = 8           # shortest tail that may realign behind the last aligned offset
MAX_AGREE = 1024         # characters of agreement measured back from a realigned offset


def prediction_ids(tokenizer, text: str) -> list[int]:
    """The prediction's token ids (no special tokens)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_prediction(tokenizer, text: str | None, prompt_tokens: int, max_model_len: int) -> list[int]:
    """The prediction's ids, refused (naming `prediction`) when longer than the context leaves after the prompt."""
    if not text:
        return []
    ids = prediction_ids(tokenizer, text)
    room = max_model_len - prompt_tokens
    if len(ids) > room:
        raise ConfigError("prediction", f"{len(ids)} tokens, longer than the {room} the context of {max_model_len} "
                                        f"leaves after the prompt ({prompt_tokens} tokens)")
    return ids


def _decoder(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)     # the Rust tokenizer: no Python wrapper per call
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class DecodedText:
    """Token ids decoded incrementally, with the character offset where each token's text ends (None while a
    token ends inside a character, its bytes completed by a later token). Each token is decoded in a window with
    the token before it, so tokenizers that join words with a space decode as they do whole."""

    def __init__(self, decode):
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""
        self.ends: list[int | None] = []    # [len(ids)] character offset after each token, None: inside a char
        self._prefix = 0                    # window start (tokens before it are final)
        self._read = 0                      # tokens whose text is in self.text
        self._before = ""                   # decode(ids[_prefix:_read])

    def extend(self, ids: list[int]) -> str:
        """Append tokens; returns the text they completed."""
        start = len(self.text)
        for t in ids:
            self.ids.append(t)
            window = self._decode(self.ids[self._prefix:])
            if len(window) > len(self._before) and not window.endswith("\ufffd"):
                self.text += window[len(self._before):]
                self.ends.append(len(self.text))
                self._close(len(self.ids))
            else:
                self.ends.append(None)
        return self.text[start:]

    def _close(self, read: int) -> None:
        self._prefix, self._read = self._read, read
        self._before = self._decode(self.ids[self._prefix: self._read])


@dataclass
class Prediction:
    """A request's prediction, decoded: its text P and where its tokens start in P."""
    ids: list[int]                          # the prediction's tokens
    text: str                               # P: the tokens decoded
    starts: dict[int, int]                  # character offset -> index of the token starting there
    bounds: list[int]                       # the same offsets, sorted
    folded: tuple[str, list[int]] = ("", [])   # P with whitespace runs as one space, and each character's offset

    @classmethod
    def build(cls, tokenizer, ids: list[int]) -> "Prediction":
        d = DecodedText(_decoder(tokenizer))
        d.extend(ids)
        starts = {0: 0}
        for j, end in enumerate(d.ends):
            if end is not None and end not in starts:
                starts[end] = j + 1
        return cls(list(ids), d.text, starts, sorted(starts), _fold(d.text))


class Aligner:
    """Where the output stands in the prediction (see the module docstring). `sync` reads the output's tokens,
    `draft` the prediction's next tokens from there."""

    def __init__(self, prediction: Prediction, tokenizer):
        self.pred = prediction
        self.tokenizer = tokenizer
        self.out = DecodedText(_decoder(tokenizer))
        self.c: int | None = 0              # aligned offset in P (None: the output departed and has not realigned)
        self.last = 0                       # the last aligned offset
        self.agree = 0                      # characters of output text agreeing with P just before c
        self._fragments: dict[int, list[int]] = {}   # offset -> its text up to P's next boundary, tokenized
        self.reflow = False                 # the output wraps lines elsewhere than P: drafts stop at P's line ends

    def sync(self, output_ids: list[int]) -> None:
        """Read the output's tokens (all of them; those already read are skipped)."""
        new = output_ids[len(self.out.ids):]
        if not new:
            return
        before = len(self.out.text)
        d = self.out.extend(new)
        P = self.pred.text
        if self.c is not None and d:
            prev_ws = before > 0 and self.out.text[before - 1].isspace()
            n, self.c, reflowed = _follow(P, self.c, d, prev_ws)
            self.reflow |= reflowed
            self.agree += n
            self.last = self.c
            if n < len(d):
                self.c, self.agree = None, 0
        if self.c is None and d:
            self._realign()

    def _realign(self) -> None:
        """Look the output's tail up in P, whitespace runs compared as one space (an answer that wraps lines
        elsewhere than the prediction still finds its place)."""
        O = self.out.text
        Pn, at = self.pred.folded
        tail_all = _fold(O[-2 * TAILS[0]:])[0]
        last = bisect.bisect_left(at, self.last)
        for L in TAILS:
            if len(tail_all) < L:
                continue
            tail = tail_all[-L:]
            i = Pn.find(tail, last)
            if i < 0 and L >= MIN_BEHIND:
                i = Pn.rfind(tail, 0, last + L - 1)
            if i >= 0:
                self.c = self.last = at[i + L - 1] + 1
                self.agree = _common_suffix(O, self.pred.text, self.c, MAX_AGREE)
                return

    @property
    def match(self) -> int:
        """Output tokens inside the agreement before c (the K policy's acceptance bucket)."""
        if not self.agree:
            return 0
        start = len(self.out.text) - self.agree
        ends = [e for e in self.out.ends[-(self.agree + 1):] if e is not None]
        return len(ends) - bisect.bisect_right(ends, start)

    def draft(self, k: int) -> list[int]:
        """Up to k of the prediction's tokens from the aligned offset ([] when there is none or P is done)."""
        c, P = self.c, self.pred
        if c is None or c >= len(P.text) or k <= 0:
            return []
        if self.reflow:
            # the output chooses its own line breaks: draft up to P's next one (the verified block's own next
            # token, free, is the output's whitespace there), not past it where a draft is wrong half the time
            nl = P.text.find("\n", c)
            end = P.bounds[bisect.bisect_right(P.bounds, nl) - 1] if nl >= 0 else len(P.text)
            if end <= c:
                end = min(len(P.text), nl + 1)
        else:
            end = len(P.text)
        j = P.starts.get(c)
        if j is not None:
            stop = P.starts.get(end, len(P.ids))
            return P.ids[j: min(j + k, stop)]
        b = bisect.bisect_right(P.bounds, c)
        nxt = P.bounds[b] if b < len(P.bounds) else len(P.text)
        frag = self._fragments.get(c)
        if frag is None:
            frag = self._fragments[c] = prediction_ids(self.tokenizer, P.text[c:nxt])
        if nxt > end:
            return []
        rest = P.ids[P.starts[nxt]: min(P.starts[nxt] + k, P.starts.get(end, len(P.ids)))] if nxt in P.starts else []
        return (frag + rest)[:k]


def _follow(P: str, c: int, d: str, prev_ws: bool) -> tuple[int, int, bool]:
    """How far the output's new text d continues P from offset c: (characters of d read, the new offset, whether
    the output spelt a line break of P as other whitespace or the other way round). A whitespace run matches any
    whitespace run (a line wrapped elsewhere, two spaces as one)."""
    i, j, n, reflowed = 0, c, len(P), False
    while i < len(d):
        a = d[i]
        if j < n and P[j] == a:
            i, j = i + 1, j + 1
        elif a.isspace() and j < n and P[j].isspace():
            reflowed |= (a == "\n") != (P[j] == "\n")
            i, j = i + 1, j + 1
        elif a.isspace() and j > 0 and P[j - 1].isspace():
            reflowed |= a == "\n"
            i += 1                                           # more whitespace in the output
        elif j < n and P[j].isspace() and ((i > 0 and d[i - 1].isspace()) or (i == 0 and prev_ws)):
            reflowed |= P[j] == "\n"
            j += 1                                           # more whitespace in the prediction
        else:
            break
    return i, j, reflowed


def _fold(text: str) -> tuple[str, list[int]]:
    """text with every whitespace run as one space, and the offset in text of each folded character."""
    out, at, ws = [], [], False
    for k, ch in enumerate(text):
        if ch.isspace():
            if ws:
                continue
            ws = True
            out.append(" ")
        else:
            ws = False
            out.append(ch)
        at.append(k)
    return "".join(out), at


def _common_suffix(O: str, P: str, c: int, cap: int) -> int:
    n = 0
    top = min(cap, len(O), c)
    while n < top and O[-1 - n] == P[c - 1 - n]:
        n += 1
    return n


class PredictedProposer(ProposerBase):
    """The prediction first, the request's own proposer (inner; None for method `none`) where it has nothing.
    `tokens` is the request's committed token list (read, never written): whether the prediction has a draft
    decides `cheap` (the K policy asks cheap proposers before it chooses K)."""
    name = "prediction"
    bursty = True

    def __init__(self, prediction: Prediction, tokenizer, prompt_len: int, tokens: list[int],
                 inner: Proposer | None, inner_k: int, device, group: "PredictedGroup | None" = None):
        self.aligner = Aligner(prediction, tokenizer)
        self.prompt_len = prompt_len
        self.tokens = tokens
        self.inner, self.inner_k = inner, inner_k
        self.device = device
        self.group = group
        self.samples = inner.samples if inner is not None else False
        self.reads_hidden = inner.reads_hidden if inner is not None else False
        self.reads_target_cache = inner.reads_target_cache if inner is not None else False

    @property
    def cheap(self) -> bool:
        if self.inner is None or self.inner.cheap:
            return True
        self.aligner.sync(self.tokens[self.prompt_len:])
        return bool(self.aligner.draft(1))

    def predicted(self, ctx: ProposeContext) -> Proposal | None:
        """The prediction's draft of at most ctx.k tokens, None when it has nothing to say."""
        self.aligner.sync(ctx.tokens[self.prompt_len:])
        ids = self.aligner.draft(ctx.k)
        if not ids:
            return None
        return Proposal(torch.tensor(ids, dtype=torch.long, device=self.device), match=self.aligner.match,
                        predicted=True)

    def inner_context(self, ctx: ProposeContext) -> ProposeContext:
        return dataclasses.replace(ctx, k=min(ctx.k, self.inner_k))

    def propose(self, ctx: ProposeContext) -> Proposal:
        p = self.predicted(ctx)
        if p is not None:
            return p
        if self.inner is None:
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device))
        return self.inner.propose(self.inner_context(ctx))

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits: torch.Tensor | None = None) -> None:
        if not proposal.predicted and self.inner is not None:
            self.inner.observe(proposal, result, extra_logits)

    def observe_hidden(self, start: int, hidden: torch.Tensor) -> None:
        if self.inner is not None:
            self.inner.observe_hidden(start, hidden)

    def lag(self, n_tokens: int) -> int:
        return self.inner.lag(n_tokens) if self.inner is not None else 0

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


class PredictedGroup:
    """The rows with a prediction whose own proposers draft in a group: each row's prediction first, the rest
    drafted together by the inner group."""

    def __init__(self, inner: ProposerGroup):
        self.inner = inner

    def propose_rows(self, proposers: list[PredictedProposer], ctxs: list[ProposeContext]) -> list[Proposal]:
        out: list[Proposal | None] = [p.predicted(c) for p, c in zip(proposers, ctxs)]
        rest = [i for i, p in enumerate(out) if p is None]
        if rest:
            props = self.inner.propose_rows([proposers[i].inner for i in rest],
                                            [proposers[i].inner_context(ctxs[i]) for i in rest])
            for i, p in zip(rest, props):
                out[i] = p
        return out


def with_prediction(inner: Proposer | None, cap: int, text: str, tokenizer, prompt_len: int, tokens: list[int],
                    device, groups: dict) -> tuple[PredictedProposer, int]:
    """A joining row's proposer and cap once it has a prediction: the prediction ahead of `inner` (its group
    wrapped once per batch in `groups`), the cap raised to PREDICTION_K (inner proposals stay within `cap`)."""
    group = None
    if inner is not None and inner.group is not None:
        key = ("prediction", id(inner.group))
        group = groups.get(key)
        if group is None:
            group = groups[key] = PredictedGroup(inner.group)
    pred = Prediction.build(tokenizer, prediction_ids(tokenizer, text))
    proposer = PredictedProposer(pred, tokenizer, prompt_len, tokens, inner, cap, device, group)
    return proposer, max(cap, PREDICTION_K)

"""Server-sent events and the JSON pieces of OpenAI responses built from engine output.

A chunk's text is what the engine released as final (engine/detok.py): never half a UTF-8 character, never part
of a stop string. Each SSE event is one `data: {json}` line and a blank line; the stream ends with
`data: [DONE]`. An error after the stream started is sent as `data: {"error": {...}}` (the OpenAI client raises
it), followed by [DONE]; when the engine failed the choice (code engine_error), a chunk with finish_reason
"error" comes first.
"""
from __future__ import annotations

import json
from functools import lru_cache

from ..engine.request import TokenLogprob
from ..engine.stats import GenerationStats
from .protocol import finite

DONE = b"data: [DONE]\n\n"
_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode      # json.dumps's separators


def sse(payload: dict) -> bytes:
    return b"data: " + _encode(payload).encode() + b"\n\n"


class ChunkEvents:
    """The SSE events of one stream's chunks, {"id", "object", "created", "model", "choices": [choice], "usage"}:
    the fields every chunk shares are serialized once, so a chunk costs the JSON of its choice (and usage) only.
    The bytes equal sse() of the same dict."""

    def __init__(self, cid: str, obj: str, created: int, model: str):
        self.head = (f'data: {{"id": {_encode(cid)}, "object": {_encode(obj)}, "created": {_encode(created)}, '
                     f'"model": {_encode(model)}, "choices": [').encode()

    def __call__(self, choice: dict, usage: dict | None = None) -> bytes:
        return b"".join((self.head, _encode(choice).encode(), b'], "usage": ',
                         b"null" if usage is None else _encode(usage).encode(), b"}\n\n"))


class TokenText:
    """Token id -> its text and bytes, for logprobs (cached; the tokenizer is the target's)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._byte_level = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
                                ).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tok.decode([token_id])
            raw = None
            if self._byte_level:
                piece = self.tok.convert_ids_to_tokens(token_id)
                dec = _byte_decoder()
                if piece is not None and all(c in dec for c in piece):
                    raw = [dec[c] for c in piece]
            hit = (text, raw if raw is not None else list(text.encode("utf-8")))
            self._cache[token_id] = hit
        return hit


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet: printable stand-in character -> byte (GPT-2's reversible mapping)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def completion_logprobs(lps: list[TokenLogprob | None], token_text: TokenText, offset: int) -> tuple[dict, int]:
    """OpenAI completions logprobs object for these tokens; text offsets start at `offset`. Returns (obj, end)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        if lp is None:        # the first prompt token under echo: nothing predicts it
            continue
        text, _ = token_text(lp.token_id)
        tokens.append(text)
        token_lps.append(finite(lp.logprob))
        top: dict[str, float] = {}
        for t, v in lp.top:                 # most likely first: tokens that decode alike keep the best
            top.setdefault(token_text(t)[0], finite(v))
        tops.append(top or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def first_prompt_entry(first_id: int, token_text: TokenText, offset: int) -> tuple[dict, int]:
    text, _ = token_text(first_id)
    return {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [offset]}, offset + len(text)


def merge_completion_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(lps: list[TokenLogprob], token_text: TokenText, top: int) -> list[dict]:
    out = []
    for lp in lps:
        text, raw = token_text(lp.token_id)
        entry = {"token": text, "logprob": finite(lp.logprob), "bytes": raw, "top_logprobs": []}
        for t, v in lp.top[:top]:
            tt, tb = token_text(t)
            entry["top_logprobs"].append({"token": tt, "logprob": finite(v), "bytes": tb})
        out.append(entry)
    return out


def usage(prompt_tokens: int, stats: list[GenerationStats]) -> dict:
    """OpenAI usage plus leaplm's `speculative` extension (figures summed over the request's choices)."""
    completion = sum(s.new_tokens for s in stats)
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    if stats:
        total = GenerationStats(stats[0].method, stats[0].k)
        for s in stats:
            total.merge(s)
        u["completion_tokens_details"] = {"accepted_prediction_tokens": total.accepted_prediction_tokens,
                                          "rejected_prediction_tokens": total.rejected_prediction_tokens}
        u["speculative"] = {
            "method": total.method, "k": total.k, "draft_tokens": total.draft_tokens,
            "accepted_tokens": total.accepted_tokens, "acceptance_rate": total.acceptance_rate,
            "mean_accepted_length": total.mean_accepted_length, "target_forwards": total.target_forwards}
    return u

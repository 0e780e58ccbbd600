"""Incremental detokenization with stop strings: text is released only when it is final.

Held back: a trailing incomplete UTF-8 sequence (decoded as U+FFFD) and any suffix that could still grow
into a stop string, so a stream never shows half a character or part of a stop string.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = list(stop or [])
        self.ids: list[int] = []
        self.emitted = 0             # characters of the final text already released
        self.text = ""               # decoded text so far (possibly unstable tail)
        self.stopped = False         # a stop string was found; text is final

    def add(self, ids: list[int]) -> str:
        """Add generated token ids; returns newly final text (may be empty)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if self.stop:
            start = max(0, self.emitted - max(map(len, self.stop)))
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = text[: min(hits)]
                self.stopped = True
                return self._release(len(self.text))
        self.text = text
        end = len(text)
        while end > self.emitted and text[end - 1] == "\ufffd":
            end -= 1
        hold = 0                     # the longest tail that is a proper prefix of a stop string
        for s in self.stop:
            for n in range(min(len(s) - 1, end - self.emitted), hold, -1):
                if text.endswith(s[:n], 0, end):
                    hold = n
                    break
        return self._release(end - hold)

    def flush(self) -> str:
        """At the end of generation: release everything that is left."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

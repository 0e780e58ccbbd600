"""Incremental detokenization with stop strings: text is released only when it is final.

Each step decodes only a short window of recent tokens (from `prefix` on), not the whole output: the text
of tokens[prefix:read] was released before, so what decode(tokens[prefix:]) adds past it is new. Held back:
a trailing incomplete UTF-8 sequence (decoded as U+FFFD) and any suffix that could still grow into a stop
string, so a stream never shows half a character or part of a stop string.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        backend = getattr(tokenizer, "backend_tokenizer", None)   # the Rust tokenizer: no Python wrapper per call
        self._decode = (lambda ids: backend.decode(ids, skip_special_tokens=True)) if backend is not None else (
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.stop = list(stop or [])
        self.max_stop = max(map(len, self.stop), default=0)
        self.ids: list[int] = []
        self.prefix = 0              # window start: tokens before it are decoded for good
        self.read = 0                # tokens whose text is already in self.text
        self.text = ""               # decoded text so far
        self.emitted = 0             # characters of self.text already released
        self.stopped = False         # a stop string was found; text is final

    def add(self, ids: list[int]) -> str:
        """Add generated token ids; returns newly final text (may be empty)."""
        if self.stopped or not ids:
            return ""
        self.ids.extend(ids)
        before = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.text += window[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        if self.stop:
            start = max(0, self.emitted - self.max_stop)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._release(len(self.text))
        end, hold = len(self.text), 0
        for s in self.stop:          # hold back the longest tail that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, end - self.emitted), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self._release(end - hold)

    def flush(self) -> str:
        """At the end of generation: release everything that is left (an unfinished character included)."""
        if not self.stopped and self.read < len(self.ids):
            before = self._decode(self.ids[self.prefix : self.read])
            self.text += self._decode(self.ids[self.prefix :])[len(before) :]
            self.read = len(self.ids)
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

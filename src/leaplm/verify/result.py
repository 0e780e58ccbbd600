from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VerifyResult:
    tokens: list[int]      # emitted: the accepted draft tokens, then one recovered or bonus token
    accepted: int          # how many draft tokens were accepted (len(tokens) - 1)
    path: list[int] | None = None   # tree verification: indices of the accepted tree nodes, root first

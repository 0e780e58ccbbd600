"""Faults injected into the native paths on purpose, so the reliability tests can check what a request and the
server go through when C++ fails. Off unless asked for: `LEAPLM_INJECT_FAULT` in the environment (a server
process reads it at start-up) or `inject()` in a test. When off, each hook costs one empty-dict test per forward.

    LEAPLM_INJECT_FAULT=SITE@POSITION[,SITE@POSITION...]

  kernel@P     the int8 kernel's C++ layer loop (kernels/qlinear.cpp, Decoder.forward) throws, halfway through
               the layers, after the first half wrote their K/V, for any forward that writes a position >= P: the
               layer list handed to C++ gets an out-of-range index there, so the exception is the loop's own
               (a c10::Error through pybind11), not one raised in Python
  llamacpp@P   llama_decode is reported as returning 1 (no KV slot for the batch, what a full context returns)
               for any decode of a position >= P, instead of being called

A position trigger fails the requests that grow past P and no other: short requests in the same batch must be
served as if nothing happened (engine/step.py scores the rows of a failed batched forward one by one).
"""
from __future__ import annotations

import os
from contextlib import contextmanager

from .config import ConfigError

ENV = "LEAPLM_INJECT_FAULT"
SITES = ("kernel", "llamacpp")

PLAN: dict[str, int] = {}           # site -> the first position that fails there (empty: no fault injected)


def parse(spec: str | None) -> dict[str, int]:
    """'kernel@300,llamacpp@200' -> {'kernel': 300, 'llamacpp': 200}; ConfigError naming the variable."""
    out: dict[str, int] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        site, _, pos = part.partition("@")
        if site not in SITES or not pos.isdigit():
            raise ConfigError(ENV, f"expected SITE@POSITION with SITE one of {', '.join(SITES)} and POSITION an "
                                   f"integer >= 0, got {part!r}")
        out[site] = int(pos)
    return out


def load_from_env() -> None:
    """PLAN from $LEAPLM_INJECT_FAULT (called once at import; a server process inherits it)."""
    PLAN.clear()
    PLAN.update(parse(os.environ.get(ENV)))


def at(site: str, last_position: int) -> bool:
    """Whether the fault planned at `site` fires for a forward whose highest written position is last_position."""
    p = PLAN.get(site)
    return p is not None and last_position >= p


@contextmanager
def inject(site: str, position: int):
    """The fault at `site` for positions >= position while the block runs (tests)."""
    if site not in SITES:
        raise ValueError(f"unknown fault site {site!r}")
    before = dict(PLAN)
    PLAN[site] = position
    try:
        yield
    finally:
        PLAN.clear()
        PLAN.update(before)


load_from_env()

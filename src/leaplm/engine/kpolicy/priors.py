"""Where a request's acceptance estimate starts: what this process has measured of its proposer before, else the
proposer's card.

Acceptance depends on the method, the target, the proposer (which draft, which head) and the temperature, so the
estimates that carry over are kept per (target, proposer) scope, method and temperature band, and shared by every
engine of the process with the same scope (a benchmark that builds one engine per configuration, a server and a
CLI run alike). The first request of a scope starts from the proposer's card where it has one: the acceptance
table of a shipped draft's README (training/modelcard.py writes it: temperature, K, mean accepted length).
"""
from __future__ import annotations

import re
from pathlib import Path

from .acceptance import AcceptanceEstimate

# (scope, method, band) -> the acceptance measured by every engine of this process with that scope
PROCESS_PRIORS: dict[tuple, dict[tuple[str, str], AcceptanceEstimate]] = {}


def temperature_band(temperature: float) -> str:
    """Requests whose acceptance is alike: greedy, T <= 0.5, T <= 1, hotter."""
    if temperature == 0:
        return "greedy"
    return "low" if temperature <= 0.5 else "mid" if temperature <= 1.0 else "high"


def acceptance_band(temperature: float, constrained: bool = False) -> str:
    """The band a request's acceptance is kept in: its temperature band, apart for structured output (a grammar's
    output is not the text a draft learnt: the embedded code draft accepts 0.44-0.56 of its tokens under a JSON
    schema where it accepts about 0.8 on code, so an estimate carried over from code kept drafting short
    constrained requests that plain constrained decoding served faster). A constrained band has no card: its
    first request starts from the prior."""
    band = temperature_band(temperature)
    return band + "+schema" if constrained else band


def shared(scope: tuple) -> dict[tuple[str, str], AcceptanceEstimate]:
    """The process's estimates of one (target, proposer) scope, keyed by (method, band)."""
    return PROCESS_PRIORS.setdefault(scope, {})


def rate_from_tau(tau: float, k: int) -> float:
    """The per-token acceptance a of a chain whose K drafts yield tau tokens a step: 1 + a + ... + a^K = tau."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(k + 1)) < tau:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def card_acceptance(model_dir: str | Path | None) -> dict[str, float]:
    """band -> per-token acceptance from a model card's acceptance table (README.md: '## Speculative decoding
    acceptance', columns temperature | K | acceptance rate | mean accepted length ...). {} without one."""
    if model_dir is None:
        return {}
    try:
        text = (Path(model_dir) / "README.md").read_text(encoding="utf-8")
    except (OSError, ValueError):
        return {}
    head = text.find("## Speculative decoding acceptance")
    if head < 0:
        return {}
    out: dict[str, float] = {}
    cols: list[str] | None = None
    for line in text[head:].splitlines()[1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cols is None:
            cols = [c.lower() for c in cells]
            continue
        if all(re.fullmatch(r":?-+:?", c) for c in cells) or len(cells) != len(cols):
            continue
        row = dict(zip(cols, cells))
        try:
            t, k, tau = float(row["temperature"]), int(row["k"]), float(row["mean accepted length"])
        except (KeyError, ValueError):
            continue
        out.setdefault(temperature_band(t), rate_from_tau(tau, k))
    return out


def from_card(rate: float, bursty: bool, strength: float = 5.0) -> AcceptanceEstimate:
    """A first request's estimate from a card's per-token acceptance, worth `strength` steps."""
    est = AcceptanceEstimate(bursty=bursty)
    for c in (est.after_hit, est.after_miss):
        c.accepted, c.rejected = strength * rate, strength * (1.0 - rate)
    return est

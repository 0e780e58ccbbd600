"""`leaplm bench project`: what speculation would give on a model of another size, from a measured block-cost curve
and acceptance measured elsewhere.

A speculative step verifies a block of T = K + 1 tokens in one target forward and emits tau tokens (the mean
accepted length, bonus or recovered token included). With c1 the cost of a one-token forward, r(T) the curve's
cost of a T-token forward over c1, p the proposer's cost per generated token and o the host work per step
(verify, commit, bookkeeping: what plain decoding spends beside its forward),

    plain decoding, per token     c1 + o
    speculation, per step         c1 (f r(T) + 1 - f) + p tau + o'
    projected speedup             tau (c1 + o) / (c1 (f r(T) + 1 - f) + p tau + o')

with o' the host work of the method's own step (o where the run did not split it out)

where f is the share of steps that drafted at all: a copying proposer (ngram, suffix) with nothing to copy drafts
no token and its step is a one-token forward. A roofline row gives f (drafting steps / forwards), the mean block T of
a drafting step (1 + drafted tokens / drafting steps: adaptive K drafts fewer than K), the drafting steps' counts by
block size, and the host time o of the method's own step (its ms per token beside score and propose, times tau).
A row's times are its run totals (ms over all its requests' tokens) where it has them, the footing of tau, itself a
ratio of sums; its per-request medians otherwise.
With the counts, r(T) is the mean of r over the drafting steps' own blocks rather than r at their mean block: a
block-cost curve is neither straight nor smooth (the kernel's token tiles make 8 tokens cheaper than 7), so a method
whose blocks vary (a suffix tree of 2 nodes here, 9 there) costs what its blocks cost, not what their mean would; a bench JSON gives totals only: a step
that drafts is taken to draft K (T = K + 1), f = drafted tokens / (forwards x K), at most 1, o plain decoding's.

The curve comes from `leaplm bench --roofline` on the target (a synthetic file of the shape: models/synth.py):
its whole-forward costs (`forwards`) or one of its block-cost `curves`, read between measured T by linear
interpolation; c1 and o from its plain-decoding row. tau, T and p come from traces: a roofline JSON's method rows
(mean_accepted_length, k, propose_ms, drafting, block) or a `leaplm bench` JSON's samples (new tokens / target
forwards; no proposer cost there: p = 0 unless given). Acceptance is a property of the model pair and the
text, so a trace measured on a small model stands in for the large one: that is the projection's assumption.

The check applies the projection to the curve and traces of one run and compares with the speedups the same run
measured (plain ms per token / the method's, or the bench's paired speedup): error = projected / measured - 1.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import ConfigError


@dataclass(frozen=True)
class CostCurve:
    """Cost of a T-token forward relative to a one-token forward, measured on one model."""
    model: str                  # the roofline's model (a path, or a shape name)
    label: str                  # "forwards" or the block curve's "kernel / weight type"
    tokens: tuple[int, ...]     # T measured, increasing
    ratio: tuple[float, ...]    # cost(T) / cost(1), per T
    one_ms: float               # c1: ms of a one-token forward (plain decoding's score per token when measured)
    host_ms: float = 0.0        # o: plain decoding's ms per token beside its forward (0 when not measured)

    def at(self, t: float) -> float:
        """r(t), linear between measured T; ConfigError outside the measured range."""
        ts, rs = self.tokens, self.ratio
        if not ts[0] <= t <= ts[-1]:
            raise ConfigError("curve", f"{self.model} ({self.label}): a block of {t:g} tokens is outside the "
                                       f"measured T = {ts[0]}..{ts[-1]}")
        for i in range(len(ts) - 1):
            if ts[i] <= t <= ts[i + 1]:
                f = (t - ts[i]) / (ts[i + 1] - ts[i])
                return rs[i] + f * (rs[i + 1] - rs[i])
        return rs[-1]


@dataclass(frozen=True)
class Trace:
    """Acceptance of one method on one workload, as a run measured it."""
    method: str                 # the run's configuration name, e.g. "ngram k=4 adaptive_k=false"
    workload: str
    tau: float                  # mean accepted length: tokens emitted per target forward
    block: float                # T = K + 1: tokens in a forward that verifies a draft
    drafting: float = 1.0       # f: share of steps that drafted (the rest are one-token forwards)
    propose_ms: float = 0.0     # p: proposer ms per generated token (0 when the run did not split it out)
    measured_speedup: float | None = None   # what the run measured against plain decoding, when it did
    source: str = ""
    decode_ratio: float | None = None       # the step's forward cost over plain decoding's, as the run's own
                                            # score times say (roofline rows): what the curve should give
    host_ms: float | None = None            # o of a step of this method (verify, commit, the K choice), when the
                                            # run split it out; None: plain decoding's
    blocks: dict[int, int] | None = None    # drafting steps by block size T (roofline rows that count them)

    def block_cost(self, curve: "CostCurve") -> float:
        """r of a drafting step on `curve`: the mean over the counted blocks, else r at the mean block."""
        if not self.blocks:
            return curve.at(self.block)
        n = sum(self.blocks.values())
        return sum(c * curve.at(t) for t, c in self.blocks.items()) / n


@dataclass
class Projection:
    shape: str
    curve: str
    method: str
    workload: str
    tau: float
    block: float
    drafting: float             # f
    cost_ratio: float           # f r(T) + 1 - f
    propose_ms: float
    speedup: float              # projected
    measured_speedup: float | None = None
    error: float | None = None  # projected / measured - 1
    decode_ratio: float | None = None   # check mode: the trace's own step cost (score ms x tau / plain score ms)


@dataclass
class ProjectionReport:
    rows: list[Projection] = field(default_factory=list)
    tolerance: float | None = None      # check mode: the largest |error| allowed
    max_error: float | None = None

    @property
    def passed(self) -> bool | None:
        if self.tolerance is None or self.max_error is None:
            return None
        return self.max_error <= self.tolerance

    def to_dict(self) -> dict:
        return {"tolerance": self.tolerance, "max_error": self.max_error, "passed": self.passed,
                "formula": "speedup = tau (c1 + o) / (c1 (f r(K+1) + 1 - f) + p tau + o)",
                "rows": [asdict(r) for r in self.rows]}


def projected_speedup(curve: CostCurve, trace: Trace, propose_ms: float | None = None) -> tuple[float, float]:
    """(speedup, cost ratio of a step f r(T) + 1 - f) of one trace on one curve; see the module docstring."""
    p = trace.propose_ms if propose_ms is None else propose_ms
    r = trace.drafting * trace.block_cost(curve) + 1 - trace.drafting
    c1, o = curve.one_ms, curve.host_ms
    o_step = o if trace.host_ms is None else trace.host_ms
    return trace.tau * (c1 + o) / (c1 * r + p * trace.tau + o_step), r


def _load(path: str | Path, field_name: str) -> dict:
    p = Path(path).expanduser()
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(field_name, f"{path}: unreadable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise ConfigError(field_name, f"{path}: expected a JSON object")
    return d


def _plain_row(d: dict) -> dict | None:
    return _footed(next((m for m in d.get("methods", []) if m.get("config") == "none"), None))


def _footed(m: dict | None) -> dict | None:
    """A roofline method row with its run totals (ms over the run's tokens: roofline.run_totals) in place of its
    per-request medians where it has them, so its times stand on the footing of its mean accepted length."""
    if m is None or not m.get("totals"):
        return m
    return {**m, **m["totals"]}


def load_curve(path: str | Path, which: str = "forwards") -> CostCurve:
    """A roofline JSON's whole-forward curve (`which` "forwards") or one of its block-cost curves, named by its
    kernel or "kernel/weight type" (the first match). c1: plain decoding's score ms per token when the JSON has
    that row, else the curve's own T = 1."""
    d = _load(path, "curve")
    model = str(d.get("model", path))
    if which == "forwards":
        pts = sorted((int(f["tokens"]), float(f["ms"])) for f in d.get("forwards", []))
        label = "forwards"
    else:
        kernel, _, wtype = which.partition("/")
        c = next((c for c in d.get("curves", []) if c.get("kernel") == kernel
                  and (not wtype or c.get("weight_type") == wtype)), None)
        if c is None:
            known = sorted({f"{c.get('kernel')}/{c.get('weight_type')}" for c in d.get("curves", [])})
            raise ConfigError("curve", f"{path}: no curve {which!r}; it has: forwards, {', '.join(known)}")
        pts = sorted(zip((int(t) for t in c["tokens"]), (float(m) for m in c["ms"])))
        label = f"{c['kernel']}/{c['weight_type']}"
    if not pts or pts[0][0] != 1 or pts[0][1] <= 0:
        raise ConfigError("curve", f"{path}: the {label} curve has no positive T = 1 cost")
    one = pts[0][1]
    plain = _plain_row(d)
    c1, host = one, 0.0
    if plain is not None and plain.get("score_ms"):
        c1 = float(plain["score_ms"])
        host = max(0.0, float(plain["ms_per_token"]) - c1)
    return CostCurve(model, label, tuple(t for t, _ in pts), tuple(ms / one for _, ms in pts), c1, host)


_K = re.compile(r"\bk=(\d+)")


def load_traces(path: str | Path) -> list[Trace]:
    """Traces of every speculative configuration in a roofline JSON (its method rows) or a `leaplm bench` JSON
    (its samples, per configuration and workload, with the summaries' paired speedups)."""
    d = _load(path, "traces")
    src = str(path)
    if "methods" in d:
        plain = _plain_row(d)
        out = []
        for m in map(_footed, d["methods"]):
            k = m.get("k") or _k_of(m["config"], 0)
            if m["config"] == "none" or not k:
                continue
            measured = float(plain["ms_per_token"]) / float(m["ms_per_token"]) if plain else None
            tau = float(m["mean_accepted_length"])
            ratio = (float(m["score_ms"]) * tau / float(plain["score_ms"])
                     if plain and plain.get("score_ms") and m.get("score_ms") else None)
            # the rows of a current roofline give the drafted share, the mean drafting block and the host time of a
            # step (a step emits tau tokens); older ones only K (f = 1, T = K + 1, plain decoding's host time)
            host = (float(m["ms_per_token"]) - float(m["score_ms"]) - float(m.get("propose_ms", 0.0))) * tau \
                if "drafting" in m else None
            blocks = {int(t): int(c) for t, c in (m.get("blocks") or {}).items()} or None
            out.append(Trace(m["config"], "roofline", tau, float(m.get("block") or 1.0 + k),
                             drafting=float(m.get("drafting", 1.0)), propose_ms=float(m.get("propose_ms", 0.0)),
                             measured_speedup=measured, source=src, decode_ratio=ratio, host_ms=host,
                             blocks=blocks))
        return out
    if "samples" not in d or "summaries" not in d:
        raise ConfigError("traces", f"{path}: neither a roofline JSON (methods) nor a bench JSON (samples)")
    speed = {(s["config"], s["workload"]): s.get("speedup") for s in d["summaries"]}
    groups: dict[tuple[str, str], list[dict]] = {}
    for s in d["samples"]:
        groups.setdefault((s["config"], s["workload"]), []).append(s)
    out = []
    for (config, workload), ss in groups.items():
        fwd, new, drafted = (sum(int(s.get(k) or 0) for s in ss) for k in ("target_forwards", "new_tokens",
                                                                            "draft_tokens"))
        if config == "none" or not fwd or not drafted:
            continue
        k = _k_of(config, int(d.get("settings", {}).get("k") or 0))
        if k <= 0:
            raise ConfigError("traces", f"{path}: no K for {config!r} (neither k=N in its name nor settings.k)")
        out.append(Trace(config, workload, new / fwd, 1.0 + k, drafting=min(1.0, drafted / (fwd * k)),
                         measured_speedup=speed.get((config, workload)), source=src))
    return out


def _k_of(config: str, default: int) -> int:
    m = _K.search(config)
    return int(m.group(1)) if m else default


def project(curves: list[CostCurve], traces: list[Trace], propose_ms: dict[str, float] | None = None,
            tolerance: float | None = None) -> ProjectionReport:
    """Every (curve, trace) pair; with `tolerance`, the check: each row's error against the trace's measured
    speedup and whether the largest |error| is within it. propose_ms: a method's proposer cost per token
    overriding the trace's (matched by the configuration's first word, e.g. "draft")."""
    rep = ProjectionReport(tolerance=tolerance)
    for c in curves:
        for t in traces:
            p = (propose_ms or {}).get(t.method.split()[0].split(":")[0])
            s, r = projected_speedup(c, t, p)
            measured = t.measured_speedup if tolerance is not None else None   # another model's, otherwise
            err = s / measured - 1 if measured else None
            rep.rows.append(Projection(c.model, c.label, t.method, t.workload, t.tau, t.block, t.drafting, r,
                                       t.propose_ms if p is None else p, s, measured, err,
                                       t.decode_ratio if tolerance is not None else None))
    errs = [abs(r.error) for r in rep.rows if r.error is not None]
    if tolerance is not None:
        if not errs:
            raise ConfigError("traces", "the check needs traces with measured speedups; none has one")
        rep.max_error = max(errs)
    return rep

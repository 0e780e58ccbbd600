"""Measure candidates within a time budget: warm-up, then rounds in which every selected configuration runs
every prompt group in an order rotated per group (A B C, B C A, ...), as the benchmark runner does; figures are
the runner's medians of ratios paired with the baseline run of the same (round, group).

Concurrency 1 is one request at a time through Engine.generate (a group is one prompt). Concurrency c > 1 goes
through the server's batch scheduler in-process, no HTTP: a group is c requests submitted together and stepped
until all finish, and its time is the wall time of the whole group (the throughput a server at that load sees).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from ..bench.runner import Sample
from ..config import ConfigError, SamplingParams
from ..models import LoadedModel
from .candidates import Candidate

log = logging.getLogger(__name__)


@dataclass
class TuneSettings:
    levels: list[int]                      # client concurrency levels
    prompts: int = 4
    max_new_tokens: int = 48
    temperature: float = 0.0
    seed: int = 0
    adaptive_k: bool = True
    budget_s: float = 300.0
    max_rounds: int = 5
    dtype: str = "float32"
    device: str = "cpu"
    draft_device: str | None = None


class BudgetTooSmall(Exception):
    def __init__(self, minimum_s: float, detail: str):
        super().__init__(detail)
        self.minimum_s, self.detail = minimum_s, detail


@dataclass
class GroupRun:
    token_ids: list[int]
    new_tokens: int
    seconds: float
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def add_stats(self, st) -> None:
        if st is None:
            return
        self.draft_tokens += st.draft_tokens
        self.accepted_tokens += st.accepted_tokens
        self.target_forwards += st.target_forwards
        for name in ("drafted_by_position", "accepted_by_position"):
            mine, theirs = getattr(self, name), getattr(st, name)
            mine += [0] * max(0, len(theirs) - len(mine))
            for i, v in enumerate(theirs):
                mine[i] += v


@dataclass
class Plan:
    setup_s: float                         # loading and timing the baseline
    baseline_group_s: dict[int, float]     # per level, one baseline group
    config_round_s: float                  # one configuration over one round (every group of every level)
    minimum_s: float                       # the smallest budget that measures the baseline and one candidate
    measured: list[Candidate] = field(default_factory=list)     # ran in at least one round
    unmeasured: list[Candidate] = field(default_factory=list)   # left out for the budget
    dropped_after_screening: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)            # engine refused to start, with why


class Measurer:
    """Builds (once) and runs the engines and schedulers the candidates need."""

    def __init__(self, target: LoadedModel, drafts: dict[str, LoadedModel], prompts: list[str],
                 settings: TuneSettings, max_model_len: int):
        self.target, self.drafts, self.prompts, self.s = target, drafts, prompts, settings
        self.max_model_len = max_model_len
        self.k_cap = 8
        self._engines: dict[Candidate, object] = {}
        self._schedulers: dict[tuple[str | None, int], object] = {}
        self._warm_s: list[float] = []

    def groups(self, level: int) -> list[list[int]]:
        """Prompt indices per group at this level: one prompt per group at 1, c prompts (cycled) above."""
        n = len(self.prompts)
        count = max(1, n // level)
        return [[(g * level + j) % n for j in range(level)] for g in range(count)]

    def _params(self, max_new: int, seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new, temperature=self.s.temperature, seed=seed, ignore_eos=True)

    def _engine(self, c: Candidate):
        from ..engine.engine import Engine

        if c not in self._engines:
            draft = self.drafts.get(c.draft_label) if c.method == "draft" else None
            self._engines[c] = Engine(self.target, draft=draft, method=c.method, k=max(1, c.k),
                                      max_model_len=self.max_model_len, adaptive_k=self.s.adaptive_k)
        return self._engines[c]

    def _scheduler(self, c: Candidate, level: int):
        """One scheduler per (draft, level); methods and K are per-request overrides, as a server's clients send."""
        from ..engine.engine import Engine
        from ..engine.scheduler import BatchScheduler

        key = (c.draft_label if c.method == "draft" else None, level)
        if key not in self._schedulers:
            draft = self.drafts.get(key[0]) if key[0] else None
            eng = Engine(self.target, draft=draft, method="draft" if draft is not None else "none", k=self.k_cap,
                         max_model_len=self.max_model_len, adaptive_k=self.s.adaptive_k)
            self._schedulers[key] = BatchScheduler(eng, max_batch=level, max_queue=level)
        return self._schedulers[key]

    def run_group(self, c: Candidate, level: int, group: list[int], max_new: int, seed: int) -> GroupRun:
        if level == 1:
            eng = self._engine(c)
            eng.forget_history()         # rounds repeat prompts: suffix must not copy its own earlier answer
            t = time.perf_counter()
            out = eng.generate(self.prompts[group[0]], self._params(max_new, seed))
            run = GroupRun(out.token_ids, len(out.token_ids), time.perf_counter() - t)
            run.add_stats(out.stats if c.method != "none" else None)
            return run
        return self._run_batched(c, level, group, max_new, seed)

    def _run_batched(self, c: Candidate, level: int, group: list[int], max_new: int, seed: int) -> GroupRun:
        from ..engine.scheduler import SeqRequest

        sched = self._scheduler(c, level)
        eng = sched.engine
        eng.forget_history()             # (as in run_group)
        outs: dict[str, list] = {}
        errors: list[str] = []

        def collect(o) -> None:
            if o.error:
                errors.append(o.error)
            outs.setdefault(o.request_id, []).append(o)

        seqs = [SeqRequest(eng.encode(self.prompts[p], self._params(max_new, seed + j)), self._params(max_new, seed + j),
                           collect, method=c.method, k=c.k if c.method != "none" else None)
                for j, p in enumerate(group)]
        t = time.perf_counter()
        sched.submit(seqs)
        sched.run_until_idle()
        dt = time.perf_counter() - t
        if errors:
            raise RuntimeError(f"{c.label} at concurrency {level}: {errors[0]}")
        run = GroupRun([], 0, dt)
        for s in seqs:
            chunks = [o.chunk for o in outs.get(s.request_id, []) if o.chunk is not None]
            ids = [t for ch in chunks for t in ch.token_ids]
            run.token_ids += ids
            run.new_tokens += len(ids)
            if c.method != "none" and chunks and chunks[-1].stats is not None:
                run.add_stats(chunks[-1].stats)
        return run

    # --- planning ---------------------------------------------------------------------------------------------
    WARM_FRACTION = 0.3         # building a candidate's engine and its short warm-up, as a share of a round

    def plan(self, baseline: Candidate, started: float) -> Plan:
        """Time one baseline group per level (this warms the baseline up) and check that the budget can measure
        the baseline and at least one candidate over one round."""
        per_level: dict[int, float] = {}
        for level in self.s.levels:
            g = self.groups(level)[0]
            self.run_group(baseline, level, g, min(8, self.s.max_new_tokens), self.s.seed)     # warm-up
            per_level[level] = self.run_group(baseline, level, g, self.s.max_new_tokens, self.s.seed).seconds
        setup = time.perf_counter() - started
        cfg_round = sum(len(self.groups(lv)) * per_level[lv] for lv in self.s.levels)
        need = (2 + self.WARM_FRACTION) * cfg_round
        minimum = math.ceil(setup + need)
        if self.s.budget_s - setup < need:
            raise BudgetTooSmall(minimum, (
                f"the baseline and one method over one round take about {need:.0f} s after {setup:.0f} s of "
                f"loading and timing the baseline"))
        return Plan(setup, per_level, cfg_round, minimum)

    def _warm(self, plan: Plan, cands: list[Candidate], levels: list[int]) -> list[Candidate]:
        """Build and warm up candidates at these levels; a candidate whose engine refuses to start is dropped
        with its family (one line in plan.refused). Records the warm-up time per (candidate, level)."""
        ok, refused = [], {r.split(":")[0] for r in plan.refused}
        for c in cands:
            if c.family in refused:
                continue
            try:
                for level in levels:
                    t = time.perf_counter()
                    self.run_group(c, level, self.groups(level)[0], min(8, self.s.max_new_tokens), self.s.seed)
                    self._warm_s.append(time.perf_counter() - t)
                ok.append(c)
            except ConfigError as e:             # e.g. layer skip on a target with too few layers
                refused.add(c.family)
                plan.refused.append(f"{c.family}: {e.message}")
        return ok

    def _round_s(self, plan: Plan, levels: list[int]) -> float:
        """One configuration over one round at these levels (baseline timing)."""
        return sum(len(self.groups(lv)) * plan.baseline_group_s[lv] for lv in levels)

    def _warm_est(self, plan: Plan) -> float:
        return max(self._warm_s) if self._warm_s else self.WARM_FRACTION * plan.config_round_s

    def measure(self, plan: Plan, candidates: list[Candidate], baseline: Candidate, started: float,
                on_sample: Callable[[Sample, Candidate, int], None] | None = None) -> tuple[list[Sample], dict]:
        """Rounds until the budget or max_rounds. When every candidate fits two rounds at every level, all run in
        every round. Otherwise the checklist's order: round 0 screens each method/draft at its first K at the
        lowest concurrency ("pick the draft"), then the K grids of the two best run at every level in the
        remaining rounds ("tune K"). Returns the samples (workload = 'c=<level>') and acceptance by position per
        (label, level)."""
        deadline = started + 0.92 * self.s.budget_s      # the rest: engines' first steps, the report
        left = lambda: deadline - time.perf_counter()  # noqa: E731
        levels = self.s.levels
        families: dict[str, list[Candidate]] = {}
        for c in candidates:
            families.setdefault(c.family, []).append(c)
        samples: list[Sample] = []
        positions: dict[tuple[str, int], GroupRun] = {}
        full = plan.config_round_s
        warm_all = len(candidates) * len(levels) * self.WARM_FRACTION * plan.config_round_s / len(levels)
        if (1 + len(candidates)) * 2 * full + warm_all <= left():
            active = self._warm(plan, candidates, levels)
        else:
            screen_levels = levels[:1]
            one = self._round_s(plan, screen_levels)
            screening = [f[0] for f in families.values()]
            m = len(screening)
            while m > 1 and (1 + m) * one + m * self.WARM_FRACTION * one > 0.6 * (left() - 2 * full):
                m -= 1
            active = self._warm(plan, screening[:m], screen_levels)
            self._round(0, [baseline] + active, samples, positions, on_sample, screen_levels)
            plan.measured += active
            ranked = self._rank([c.family for c in active], samples)
            keep = ranked[:2]
            plan.dropped_after_screening = ranked[2:]
            grid = [c for f in keep for c in families[f]]
            warm = self._warm_est(plan) * len(levels)
            n = len(grid)
            while n > 1 and (1 + n) * full + n * warm > left():
                n -= 1
            active = self._warm(plan, grid[:n], levels)
        r0 = 1 + max((s.round for s in samples), default=-1)
        last_round = None
        for r in range(r0, self.s.max_rounds):
            est = last_round if last_round is not None else (1 + len(active)) * full
            if r > 0 and time.perf_counter() + est > deadline:
                break
            t = time.perf_counter()
            self._round(r, [baseline] + active, samples, positions, on_sample, levels)
            last_round = time.perf_counter() - t
            plan.measured += [c for c in active if c not in plan.measured]
        plan.unmeasured = [c for c in candidates if c not in plan.measured]
        return samples, {k: [a / d if d else 0.0 for a, d in zip(v.accepted_by_position, v.drafted_by_position)]
                         for k, v in positions.items()}

    def _round(self, r: int, configs: list[Candidate], samples: list[Sample], positions: dict, on_sample,
               levels: list[int]) -> None:
        for level in levels:
            for gi, g in enumerate(self.groups(level)):
                shift = (r + gi) % len(configs)
                for c in configs[shift:] + configs[:shift]:
                    run = self.run_group(c, level, g, self.s.max_new_tokens, self.s.seed + 1000 * gi)
                    s = Sample(c.label, f"c={level}", gi, r, run.new_tokens, run.seconds, run.token_ids,
                               run.draft_tokens, run.accepted_tokens, run.target_forwards)
                    samples.append(s)
                    positions.setdefault((c.label, level), GroupRun([], 0, 0.0)).add_stats(run)
                    if on_sample:
                        on_sample(s, c, level)

    @staticmethod
    def _rank(families: list[str], samples: list[Sample]) -> list[str]:
        """Families by their mean speedup over the levels in the samples so far, best first."""
        from ..bench.runner import summarize

        by_label = {}
        for s in summarize(samples, "none"):
            by_label.setdefault(s.config, []).append(s.speedup or 0.0)
        score = {}
        for label, sp in by_label.items():
            fam = label.rsplit(" k=", 1)[0]
            if fam in families:
                score[fam] = max(score.get(fam, 0.0), sum(sp) / len(sp))
        return sorted(families, key=lambda f: -score.get(f, 0.0))

    def close(self) -> None:
        self._schedulers.clear()
        self._engines.clear()


def check_levels(levels: list[int]) -> None:
    if not levels or any(not isinstance(c, int) or c < 1 or c > 256 for c in levels):
        raise ConfigError("concurrency", f"levels must be integers in [1, 256], got {levels}")

"""Per-request speculation figures, as data: the CLI, server, logs and benchmarks only read them."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    method: str
    k: int                                  # the configured K (the adaptive controller may use less per step)
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0                # decode-time target forwards (prefill not counted)
    draft_tokens: int = 0                   # drafted (proposed) tokens
    accepted_tokens: int = 0
    steps_with_draft: int = 0               # steps that proposed at least one token
    drafted_by_position: list[int] = field(default_factory=list)    # [K] how often position i was proposed
    accepted_by_position: list[int] = field(default_factory=list)   # [K] how often position i was accepted
    prefill_s: float = 0.0
    decode_s: float = 0.0
    propose_s: float = 0.0                  # decode time spent in the proposer
    score_s: float = 0.0                    # decode time spent in target forwards
    verify_s: float = 0.0                   # decode time spent verifying drafts against the scored logits
    commit_s: float = 0.0                   # decode time spent committing (tokens, stops, cache, proposer updates)
    forced_tokens: int = 0                  # structured output: tokens the grammar forced, drafted for free
    forced_accepted: int = 0                # ... and accepted (not in draft_tokens / accepted_tokens)
    grammar_s: float = 0.0                  # decode time spent in the grammar (masks, forced tokens, advancing)
    accepted_prediction_tokens: int = 0     # Predicted Outputs: drafted prediction tokens the output kept
    rejected_prediction_tokens: int = 0     # ... and drafted but not kept (both also in draft/accepted_tokens)
    shadow_s: float = 0.0                   # decode time spent scoring the proposer at K = 0 (kpolicy/shadow.py)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward, the recovered/bonus token included (plain decoding: 1)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def record_step(self, drafted: int, accepted: int, emitted: int) -> None:
        self.target_forwards += 1
        self.new_tokens += emitted
        if drafted:
            self.steps_with_draft += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            if len(self.drafted_by_position) < drafted:
                grow = drafted - len(self.drafted_by_position)
                self.drafted_by_position += [0] * grow
                self.accepted_by_position += [0] * grow
            for i in range(drafted):
                self.drafted_by_position[i] += 1
            for i in range(accepted):
                self.accepted_by_position[i] += 1

    def merge(self, other: "GenerationStats") -> None:
        """Accumulate another request's figures (for -n samples and benchmark totals)."""
        for f in ("prompt_tokens", "new_tokens", "target_forwards", "draft_tokens", "accepted_tokens",
                  "steps_with_draft", "prefill_s", "decode_s", "propose_s", "score_s",
                  "verify_s", "commit_s", "forced_tokens", "forced_accepted", "grammar_s",
                  "accepted_prediction_tokens", "rejected_prediction_tokens", "shadow_s"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        n = max(len(self.drafted_by_position), len(other.drafted_by_position))
        for name in ("drafted_by_position", "accepted_by_position"):
            a, b = getattr(self, name), getattr(other, name)
            setattr(self, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 tokens_per_s=self.tokens_per_s, acceptance_by_position=self.acceptance_by_position)
        return d


@dataclass
class StartupTimes:
    """Seconds an engine spent before its first token, by part (`leaplm generate --startup` prints them)."""
    load_s: float = 0.0          # the target: weights (and the kernel's library), config, tokenizer
    draft_s: float = 0.0         # the draft model (method draft) and the check that it shares the tokenizer
    checks_s: float = 0.0        # --backend auto's timing of both engines, llama.cpp's batch-invariance check,
                                 # the thread check, the cost calibration (read from the start-up cache after the
                                 # first start: startup_cache.py)
    cache_s: float = 0.0         # the first batch's KV cache


@dataclass
class StepClock:
    """Seconds of one batched step by stage, charged to its rows' stats (each row: its own proposing, verifying,
    committing and tree forward; every row: the batched forward and the whole step as decode time)."""
    start: float = field(default_factory=time.perf_counter)
    decode_start: float = 0.0            # when decoding began (after this step's prefill)
    stop: float = 0.0                    # when the step ended
    propose: float = 0.0
    batched: float = 0.0                 # the batched target forward
    score: float = 0.0                   # target forwards: the batched one and every tree row's own
    verify: float = 0.0
    commit: float = 0.0

    def decoding(self) -> None:
        self.decode_start = time.perf_counter()

    def batched_score(self, seconds: float) -> None:
        self.batched = seconds
        self.score += seconds

    def row(self, stats: GenerationStats, score_s: float, verify_s: float, commit_s: float) -> None:
        """One row's own stages (score_s: its tree forward, 0 for a chain row)."""
        stats.score_s += score_s
        stats.verify_s += verify_s
        stats.commit_s += commit_s
        self.score += score_s
        self.verify += verify_s
        self.commit += commit_s

    def end(self, rows) -> None:
        """The step is over: every row's stats get the batched forward and the step's time."""
        self.stop = time.perf_counter()
        for r in rows:
            r.req.stats.score_s += self.batched
            r.req.stats.decode_s += self.total

    @property
    def total(self) -> float:
        return self.stop - self.start

"""What an engine has measured, shared by every batch it runs (the one cost calibration): batched forward costs
(costs.py), proposer seconds per drafted token and acceptance per method, a draft model's prefill cost, and the
measured rates (measured.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .acceptance import AcceptanceEstimate
from .costs import BatchCostModel
from .measured import RateBandit


def rows_bucket(n: int) -> int:
    """n rounded up to a power of two (costs measured at 5 rows stand for 5..8)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass
class Estimates:
    """What an engine has measured, shared by every batch it runs (the one cost calibration): batched forward
    costs, proposer seconds per drafted token and acceptance per method, a draft model's prefill cost."""
    costs: BatchCostModel = field(default_factory=BatchCostModel)
    propose_s: dict[str, float] = field(default_factory=dict)       # method -> EMA of seconds per drafted token
    # (method, rows bucket) -> the same, for proposers that draft for many rows at once (the draft model): its
    # forward over n rows costs far less than n forwards, so its cost per drafted token depends on n
    propose_s_rows: dict[tuple[str, int], float] = field(default_factory=dict)
    # (method, temperature band) -> acceptance over all its requests (slow EMA): the starting estimate of a new
    # request's row; an engine shares it with the process's other engines of the same target and proposer
    # (priors.shared)
    method_acceptance: dict[tuple[str, str], AcceptanceEstimate] = field(default_factory=dict)
    card: dict[str, float] = field(default_factory=dict)   # band -> per-token acceptance on the proposer's card
    draft_prefill_s_per_token: float = 0.0
    calibrated_rows: set[int] = field(default_factory=set)          # batch sizes step.calibrate has measured
    # committed tokens per wall-second of each K, per arm class (measured.py): overrules what the costs miss
    rates: RateBandit = field(default_factory=RateBandit)

    def observe_propose(self, method: str, seconds_per_token: float, rows: int | None = None) -> None:
        """rows: how many rows drafted together (None: a proposer that drafts row by row)."""
        old = self.propose_s.get(method)
        self.propose_s[method] = seconds_per_token if old is None else 0.9 * old + 0.1 * seconds_per_token
        if rows is not None:
            key = (method, rows_bucket(rows))
            old = self.propose_s_rows.get(key)
            self.propose_s_rows[key] = seconds_per_token if old is None else 0.9 * old + 0.1 * seconds_per_token

    def propose_cost(self, method: str, rows: int) -> float:
        """Seconds per drafted token of `method` when `rows` rows draft in one step."""
        by_rows = self.propose_s_rows.get((method, rows_bucket(rows)))
        return by_rows if by_rows is not None else self.propose_s.get(method, 0.0)

    def acceptance(self, method: str, bursty: bool = True, band: str = "greedy") -> AcceptanceEstimate:
        """`method`'s acceptance over all its requests in a temperature band (created on first use; bursty: see
        AcceptanceEstimate)."""
        return self.method_acceptance.setdefault((method, band), AcceptanceEstimate(decay=0.98, bursty=bursty))

    def observe_acceptance(self, method: str, drafted: int, accepted: int, asked: int | None = None,
                           match: int | None = None, known: bool = False, bursty: bool = True,
                           band: str = "greedy") -> None:
        """A step of a row of `method` (drafted 0: its proposer had nothing to propose)."""
        self.acceptance(method, bursty, band).observe(drafted, accepted, asked, match, known)

    def observe_expected(self, method: str, passed: list[float], match: int | None = None,
                         bursty: bool = True, band: str = "greedy") -> None:
        """Evidence gathered at K = 0 for a row of `method` (AcceptanceEstimate.observe_expected)."""
        self.acceptance(method, bursty, band).observe_expected(passed, match)

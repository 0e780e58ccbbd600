"""What a step tells the K policy: the one interface through which its timings and outcomes leave the step.

kpolicy.policy.KPolicy implements it; besides it the step (step.py and the stages: proposing.py, scoring.py,
commit.py) calls only the policy's `plan`, `new_acceptance` and `catchup_s`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .kpolicy.policy import RowStep, StepPlan
    from .row import Row


class StepObserver(Protocol):
    def observe_propose(self, method: str, seconds_per_token: float, rows: int | None = None) -> None:
        """A proposal's seconds per drafted token (without a draft model's catching up); rows: how many rows
        drafted together (None: a proposer that drafts row by row)."""

    def observe_forward(self, rows: int, block_len: int, seconds: float) -> None:
        """A target forward over [rows, block_len] took seconds (the batched one, or a tree row's own)."""

    def observe(self, rows: list[Row], plan: StepPlan, done: list[RowStep | None], timed: bool = True,
                wall: float | None = None) -> None:
        """The step is over: what each row did (None: it failed), whether it was a choice of K (timed) and its
        wall seconds."""

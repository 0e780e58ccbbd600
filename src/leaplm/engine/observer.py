"""What a step tells the K policy: the one interface through which its timings and outcomes leave the step.

kpolicy.policy.KPolicy implements it; besides it the step (step.py and the stages: proposing.py, scoring.py,
commit.py) calls only the policy's `plan`, `new_acceptance` and `catchup_s`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..propose.base import Proposal
    from .kpolicy.policy import RowStep, StepPlan
    from .row import Row


class StepObserver(Protocol):
    def observe_propose(self, method: str, seconds_per_token: float, rows: int | None = None) -> None:
        """A proposal's seconds per drafted token (without a draft model's catching up); rows: how many rows
        drafted together (None: a proposer that drafts row by row)."""

    def observe_forward(self, rows: int, block_len: int, seconds: float) -> None:
        """A target forward over [rows, block_len] took seconds (the batched one, or a tree row's own)."""

    def proposed(self, proposals: list[Proposal | None]) -> None:
        """The step's proposals, before any is scored (None: the row drafted nothing)."""

    def observe(self, rows: list[Row], plan: StepPlan, done: list[RowStep | None], seconds: float,
                catchup_s: float, timed: bool = True) -> None:
        """The step is over: what each row did (None: it failed) and the seconds the policy measures."""

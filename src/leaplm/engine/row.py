"""A running request as the batch step holds it (engine/step.py) and the K policy reads it (engine/kpolicy/policy.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..propose.base import Proposer
from ..sampling import LogitsProcessor
from .kpolicy.acceptance import AcceptanceEstimate
from .request import Request


@dataclass
class Row:
    """One running request: the batch's state for it."""
    req: Request
    proc: LogitsProcessor
    proposer: Proposer | None
    cap: int                                         # this request's own K (0: no speculation)
    fixed_k: bool = False                            # draft cap tokens every step (the request asked adaptive_k off)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)   # the K policy's, for this row
    extra_tokens: float = 0.0                        # EMA of tokens a proposal adds beyond its K (lookahead)
    tag: object = None                               # the caller's handle (the scheduler's SeqRequest)
    prefilled: int = 0                               # prompt tokens in the cache (all but the last: prefill done)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.req.prompt_ids) - 1

    @property
    def reads_hidden(self) -> bool:
        """Its proposer reads the target's features (EAGLE, Medusa): forwards return the hidden states too."""
        return self.proposer is not None and self.proposer.reads_hidden

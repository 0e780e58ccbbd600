"""A running request as the batch step holds it (engine/step.py) and the K policy reads it (engine/kpolicy/policy.py)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from ..propose.base import Proposer
from ..sampling import LogitsProcessor
from .kpolicy.acceptance import AcceptanceEstimate
from .kpolicy.shadow import ShadowState
from .request import Request, StreamChunk


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
    shadow: ShadowState = field(default_factory=ShadowState)   # the K policy's evidence at K = 0
    band: str = "greedy"                             # its acceptance band (kpolicy/priors.py acceptance_band)
    pending: Future | None = None                    # its grammar work in a worker: it sits steps out until done
                                                     # (engine/constrain.py GrammarWork)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.req.prompt_ids) - 1

    @property
    def reads_hidden(self) -> bool:
        """Its proposer reads the target's features (EAGLE, Medusa): forwards return the hidden states too."""
        return self.proposer is not None and self.proposer.reads_hidden


GRAMMAR_ERROR = "grammar error: "      # how a request whose own grammar failed ends (the server answers it as a 400)


def engine_error(e: BaseException) -> str:
    """The error a request ends with when the engine failed it: the exception's type and first line (a C++
    exception through pybind11 carries the C++ backtrace on the lines after); its grammar's failure is told
    apart (GRAMMAR_ERROR)."""
    from ..structured.state import GrammarError

    text = str(e).strip().splitlines()
    first = text[0][:500] if text else "no message"
    if isinstance(e, GrammarError):
        return GRAMMAR_ERROR + first
    return f"engine error: {type(e).__name__}: {first}"


@dataclass
class RowOutput:
    """What one step produced for one row: a chunk (finish_reason set on the last), or an error that ended it."""
    row: Row
    chunk: StreamChunk | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.chunk is not None and self.chunk.finish_reason is not None)

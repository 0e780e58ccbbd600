"""What the engine knows about one request while generating it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import SamplingParams
from ..structured.state import GrammarState
from .detok import IncrementalDetokenizer
from .stats import GenerationStats


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float                                   # the target's raw log-probability of token_id
    top: list[tuple[int, float]] = field(default_factory=list)   # (token id, logprob), most likely first


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[int]                                # prompt + committed output
    stop_ids: frozenset[int]                         # EOS (unless ignore_eos) and stop_token_ids
    detok: IncrementalDetokenizer
    stats: GenerationStats
    generator: torch.Generator | None = None         # only for sampling requests (proposers that draw sequentially)
    seed: int | None = None                          # sampling requests: 64 bits, fix every position's sample
    presence: torch.Tensor | None = None             # [V] bool, only with a repetition penalty
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None                 # "length" | "stop" | "constraint" (the grammar admits nothing)
    verifier: str = "greedy"                         # "greedy" | "rejection" | "race" (engine/verification.py)
    explicit_verifier: bool = False                  # the request or the engine named it (not 'auto')
    grammar: GrammarState | None = None              # structured output: the committed tokens' grammar state

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - (len(self.tokens) - len(self.prompt_ids))


@dataclass
class StreamChunk:
    text: str                            # newly final text
    token_ids: list[int]                 # tokens committed by this step
    finish_reason: str | None = None     # set on the last chunk
    stats: GenerationStats | None = None # set on the last chunk
    logprobs: list[TokenLogprob] | None = None

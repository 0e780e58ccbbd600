"""The engine: one request at a time, each step four calls.

  1. propose  the proposer guesses up to K tokens (a chain, or a tree)
  2. score    one target forward over [last committed token, drafts...]
  3. verify   a pure function keeps the prefix the target agrees with, plus one token of its own
  4. commit   the only stage that changes state: cache length, tokens, stats, the proposer's view

The target cache holds every committed token except the last, which opens the next step's block.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import ConfigError, SamplingParams, SpecConfig
from ..models import LoadedModel, load_model
from ..models import embedded
from ..models.tokens import encode_prompt
from ..propose.base import Proposal, ProposeContext
from ..propose.registry import make_proposer_factory
from ..sampling import LogitsProcessor
from ..verify import VerifyResult
from .adaptive import AdaptiveK, CostModel
from .commit import commit, finish_chunk, new_request, verify_chain
from .commit import token_logprobs  # noqa: F401  (re-exported: its home before the refactor)
from .tree_step import extra_logits, tree_block, verify_tree
from .request import Request, StreamChunk, TokenLogprob
from .stats import GenerationStats

log = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]                 # generated tokens only
    finish_reason: str                   # "length" | "stop"
    stats: GenerationStats
    prompt_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class Engine:
    """Lossless speculative decoding for one Hugging Face causal LM.

    Engine(model=None, draft=None, method=None, k=5) with no model uses the embedded family (target and its
    best draft). method defaults to 'draft' when a draft is known, else 'none'.
    """

    def __init__(self, model: str | LoadedModel | None = None, draft: str | LoadedModel | None = None,
                 method: str | None = None, k: int = 5, *, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int | None = None, spec: SpecConfig | None = None, **spec_options):
        if model is None:
            model = embedded.default_target()
            if draft is None and method in (None, "draft"):
                draft = embedded.default_draft()
        self.target = model if isinstance(model, LoadedModel) else load_model(model, device, dtype, "model")
        if spec is None:
            method = method or ("draft" if draft is not None else "none")
            draft_name = draft.name if isinstance(draft, LoadedModel) else draft
            spec = SpecConfig(method=method, k=k, draft=draft_name, **spec_options)
        self.spec = spec
        self.draft: LoadedModel | None = None
        if spec.method == "draft":
            src = draft if draft is not None else spec.draft
            self.draft = src if isinstance(src, LoadedModel) else load_model(src, device, dtype, "draft")
            check_vocab(self.target, self.draft)
        self.tokenizer = self.target.tokenizer
        self.model = self.target.model
        self.max_model_len = min(max_model_len or self.model.max_len, self.model.max_len)
        if self.draft is not None and self.draft.model.max_len < self.max_model_len:
            # the draft must see every committed token: past its positions it would fail mid-request
            log.warning("draft %s has a context of %d positions, shorter than %d: requests are limited to %d",
                        self.draft.name, self.draft.model.max_len, self.max_model_len, self.draft.model.max_len)
            self.max_model_len = self.draft.model.max_len
        self._proposer_factory = make_proposer_factory(spec, self.target, self.draft)
        self._cache = None
        self._cache_busy = False
        self.costs = CostModel()
        if self._proposer_factory is not None and spec.adaptive_k:
            self._calibrate()

    # --- public API ------------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> GenerationOutput:
        params = params or SamplingParams()
        chunks = list(self._run(self.encode(prompt, params), params))
        last = chunks[-1]
        req_ids = [t for c in chunks for t in c.token_ids]
        lps = [lp for c in chunks for lp in (c.logprobs or [])] if params.logprobs is not None else None
        return GenerationOutput("".join(c.text for c in chunks), req_ids, last.finish_reason, last.stats,
                                self._last_prompt_ids, lps)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        params = params or SamplingParams()
        return self._run(self.encode(prompt, params), params)

    def encode(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Prompt to token ids, refusing what cannot run (empty, unknown ids, longer than the context)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ConfigError("prompt", "must not be empty")
            ids = encode_prompt(self.tokenizer, prompt, self.target.bos_id)
        else:
            ids = list(prompt)
            V = self.model.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < V]
            if bad:
                raise ConfigError("prompt", f"token ids must be integers in [0, {V}), got {bad[:5]}")
        if not ids:
            raise ConfigError("prompt", "must not be empty")
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise ConfigError("max_new_tokens", f"prompt ({len(ids)} tokens) + max_new_tokens "
                                                f"({params.max_new_tokens}) exceed the context of {self.max_model_len}")
        return ids

    # --- the step loop -----------------------------------------------------------------------------------------
    def _new_request(self, ids: list[int], params: SamplingParams) -> Request:
        return new_request(ids, params, tokenizer=self.tokenizer, eos_token_ids=self.target.eos_token_ids,
                           vocab_size=self.model.vocab_size, device=self.model.device, method=self.spec.method,
                           k=self.spec.k if self._proposer_factory else 0)

    def _run(self, ids: list[int], params: SamplingParams) -> Iterator[StreamChunk]:
        self._last_prompt_ids = ids
        req = self._new_request(ids, params)
        proc = LogitsProcessor(params)
        cache = self._acquire_cache()
        try:
            yield from self._steps(req, proc, cache)
        finally:
            self._release_cache(cache)

    def _steps(self, req: Request, proc: LogitsProcessor, cache) -> Iterator[StreamChunk]:
        ids, params = req.prompt_ids, req.params
        proposer = self._proposer_factory(self.max_model_len) if self._proposer_factory else None
        ctl = AdaptiveK(self.spec.k, self.costs, enabled=self.spec.adaptive_k,
                        propose_s_per_token=self.costs.propose_s_per_token) if proposer else None
        dev = self.model.device

        t0 = time.perf_counter()
        if len(ids) > 1:                     # prefill all but the last prompt token
            self.model(torch.tensor([ids[:-1]], device=dev), cache, last_only=True)
            cache.advance(len(ids) - 1)
        t1 = time.perf_counter()
        req.stats.prefill_s = t1 - t0

        while req.finish_reason is None:
            ts = time.perf_counter()
            # 1. propose
            room = self.max_model_len - len(req.tokens) - 1
            k = min(ctl.choose(), room) if ctl else 0
            proposal = None
            if k > 0:
                proposal = proposer.propose(ProposeContext(req.tokens, k, params, proc, req.generator,
                                                           req.presence, cache))
            tp = time.perf_counter()
            # 2. score + 3. verify
            if proposal is not None and proposal.parents is not None:
                result, logits = self._score_verify_tree(req, proposal, proc, cache)
            else:
                result, logits = self._score_verify_chain(req, proposal, proc, cache)
            tv = time.perf_counter()
            # 4. commit
            drafted = proposal.k if proposal is not None else 0
            if proposal is not None:
                proposer.observe(proposal, result, extra_logits(proposal, logits))
            if ctl:
                ctl.observe(drafted, result.accepted, tp - ts, tv - tp, scored=logits.shape[0])
            chunk = self._commit(req, result, logits, drafted, cache)
            te = time.perf_counter()
            req.stats.propose_s += tp - ts
            req.stats.score_s += tv - tp
            req.stats.decode_s += te - ts
            finish_chunk(req, chunk)
            if chunk.text or chunk.token_ids or chunk.finish_reason:
                yield chunk

    def _score_verify_chain(self, req: Request, proposal: Proposal | None, proc: LogitsProcessor, cache):
        drafts = proposal.tokens if proposal is not None else torch.empty(0, dtype=torch.long)   # [K]
        block = torch.cat([torch.tensor([req.tokens[-1]], device=drafts.device), drafts]).unsqueeze(0)
        logits = self.model(block, cache)[0]                                                  # [K+1, V]
        return verify_chain(req, proposal, proc, logits), logits

    def _score_verify_tree(self, req: Request, proposal: Proposal, proc: LogitsProcessor, cache):
        block = tree_block(req, proposal)
        logits = self.model(block.ids.unsqueeze(0), cache, tree_mask=block.layout.mask,
                            position_offsets=block.layout.depths)[0]                    # [T, V]
        return verify_tree(req, proposal, proc, logits, block.layout), logits

    def _commit(self, req: Request, result: VerifyResult, logits: torch.Tensor, drafted: int, cache) -> StreamChunk:
        return commit(req, result, logits, drafted, cache)

    # --- internals ---------------------------------------------------------------------------------------------
    def _acquire_cache(self):
        """The engine's preallocated cache, or a fresh one while another stream still holds it (two
        interleaved streams must not share slots)."""
        if self._cache is None:
            self._cache = self.model.new_cache(1, self.max_model_len)
        elif self._cache_busy:
            return self.model.new_cache(1, self.max_model_len)
        self._cache_busy = True
        self._cache.truncate(0)
        return self._cache

    def _release_cache(self, cache) -> None:
        if cache is self._cache:
            self._cache_busy = False

    def _calibrate(self) -> None:
        """Measure target forward cost over T = 1..K+1 tokens for the adaptive K controller."""
        cache = self.model.new_cache(1, self.max_model_len)
        ctx = min(64, self.max_model_len // 2)
        self.model(torch.zeros(1, ctx, dtype=torch.long, device=self.model.device), cache)
        cache.advance(ctx)
        for T in list(range(1, self.spec.k + 2)) * 3:
            t = time.perf_counter()
            self.model(torch.zeros(1, T, dtype=torch.long, device=self.model.device), cache)
            self.costs.observe(T, time.perf_counter() - t)
        if self.draft is not None:      # a draft token costs at least one draft forward: known before step 1
            d = self.draft.model
            dc = d.new_cache(1, self.max_model_len)
            d(torch.zeros(1, ctx, dtype=torch.long, device=d.device), dc)
            dc.advance(ctx)
            times = []
            for _ in range(3):
                t = time.perf_counter()
                d(torch.zeros(1, 1, dtype=torch.long, device=d.device), dc, last_only=True)
                times.append(time.perf_counter() - t)
            self.costs.propose_s_per_token = sorted(times)[1]


def check_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    vt, vd = target.model.vocab_size, draft.model.vocab_size
    if vt != vd:
        raise ConfigError("draft", f"draft vocab size {vd} differs from target vocab size {vt}; "
                                   "the draft must share the target's tokenizer")
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ConfigError("draft", f"draft tokenizer differs from the target's (both have vocab size {vt})")

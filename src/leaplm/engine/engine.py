"""The public API: Engine.generate and Engine.stream run a request as a batch of one through the one batched
step (engine/step.py: propose, score, verify, commit); the server's scheduler runs many rows through the same step.

The target cache holds every committed token except the last, which opens the next step's block.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator


from ..config import MAX_SAMPLES, METHODS, ConfigError, EngineConfig, SamplingParams, SpecConfig, StructuredOutput
from ..models import LoadedModel, load_model
from ..models.loading import (NOT_INVARIANT, BackendChoice, choose_target_backend, draft_backend,
                              resolve_max_model_len)
from ..models import embedded
from ..propose.base import Proposer
from ..propose.registry import make_proposer_factory
from ..structured.state import GrammarState, GrammarVocab
from .kpolicy.estimates import Estimates
from .kpolicy.priors import card_acceptance, shared
from .prepare import PreparedRequest, PromptInput, check_context, prepare, prompt_ids
from .request import StreamChunk, TokenLogprob
from .startup_checks import cached_calibrate, cached_check_threads
from .step import Batch
from .stats import GenerationStats, StartupTimes

log = logging.getLogger(__name__)


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]                 # generated tokens only
    finish_reason: str                   # "length" | "stop" | "constraint" (the grammar admitted no token)
    stats: GenerationStats
    prompt_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class Engine:
    """Lossless speculative decoding for one Hugging Face causal LM.

    Built from one EngineConfig (config.py), given as `config=` or as the keyword arguments below, which make one;
    `self.config` keeps it. Engine(model=None, draft=None, method=None, k=5) with no model uses the embedded family
    (target and its best draft). method defaults to 'draft' when a draft is known, else 'none'. quantization ('int8', 'int4',
    'gguf'; quant/apply.py) applies to the target and the draft; the promise is then identity with plain
    decoding of the same quantized model. max_num_batched_tokens: the tokens a step may feed the target (vLLM's
    name); a longer prompt is prefilled in chunks between decoding steps of the other rows (engine/step.py).
    None: every prompt is prefilled whole when it joins. backend: 'auto' | 'llamacpp' | 'torch'
    (models/loading.choose_backend): what runs a GGUF target's and draft's forwards; `self.backend` says which.
    """

    def __init__(self, model: str | LoadedModel | None = None, draft: str | LoadedModel | None = None,
                 method: str | None = None, k: int = 5, *, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int | None = None, spec: SpecConfig | None = None, draft_device: str | None = None,
                 quantization: str | None = None, max_num_batched_tokens: int | None = None,
                 kv_cache_dtype: str = "auto", backend: str = "auto", config: EngineConfig | None = None,
                 **spec_options):
        if config is None:                           # the keyword arguments are one EngineConfig
            head = spec_options.pop("head", None)
            config = EngineConfig(model, draft, method, k, head, spec, spec_options, backend, device, draft_device,
                                  dtype, quantization, kv_cache_dtype, None, max_model_len, max_num_batched_tokens)
        elif not isinstance(config, EngineConfig):
            raise ConfigError("config", f"must be an EngineConfig, got {type(config).__name__}")
        elif (model, draft, method, spec, spec_options) != (None, None, None, None, {}):
            raise ConfigError("config", "give the engine's settings in config alone, not beside it")
        self.config = config
        self.startup = StartupTimes()                # what the start cost, by part
        self._build(config)

    def _build(self, config: EngineConfig) -> None:
        """Load the models and decide the speculation from config, once."""
        model, draft, method, k, spec = config.model, config.draft, config.method, config.k, config.spec
        spec_options = dict(config.spec_options, **({"head": config.head} if config.head is not None else {}))
        device, dtype, draft_device, backend = config.device, config.dtype, config.draft_device, config.backend
        quantization, kv_cache_dtype = config.quantization, config.kv_cache_dtype
        max_model_len, max_num_batched_tokens = config.max_model_len, config.max_num_batched_tokens
        if config.threads is not None:
            import torch

            torch.set_num_threads(config.threads)
        if draft_device is not None:                 # the draft on another device than the target
            from ..devices import check_device

            check_device(draft_device, "draft_device")
        check_names(draft if draft is not None else spec.draft if spec is not None else None,
                    spec.head if spec is not None else spec_options.get("head"), backend)
        if model is None:
            model = embedded.default_target()
            wants_default = (spec.method == "draft" and spec.draft is None) if spec is not None else \
                method in (None, "draft")         # a spec's own draft is never replaced by the default
            if draft is None and wants_default:
                draft = embedded.default_draft()
        # the backend before loading: a speculating method on a Q8_0/Q4_x file runs on leaplm's int8 kernel under
        # auto (models/loading.auto_backend says why)
        if isinstance(model, LoadedModel):
            choice = BackendChoice(model.backend, quantization, "the caller's loaded model")
            self.target = model
        else:
            first = spec.method if spec is not None else method or ("draft" if draft is not None else "none")
            t0 = time.perf_counter()          # --backend auto may time both engines on the file (once: cached)
            choice = choose_target_backend(model, first if first in METHODS else "none", backend, device, dtype,
                                           quantization, kv_cache_dtype)
            self.startup.checks_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            self.target = load_model(model, device, dtype, "model", choice.quantization or quantization,
                                     kv_cache_dtype, choice.backend)
            self.startup.load_s += time.perf_counter() - t0
        self.backend_reason = choice.reason
        if draft is None and (method == "draft" or (spec is not None and spec.method == "draft" and spec.draft is None)):
            # --method draft without --draft: the shipped draft trained for this target (matched by tokenizer).
            # Not made the default method: how much it pays depends on the draft (see its model card)
            draft = embedded.draft_for(self.target.tokenizer)
        if spec is None:
            method = method or ("draft" if draft is not None else "none")
            draft_name = draft.name if isinstance(draft, LoadedModel) else draft
            spec = SpecConfig(method=method, k=k, draft=draft_name, **spec_options)
        self.spec = spec
        # the check was not in the start-up cache (choose_target_backend reads it there): measured on the loaded
        # model, the one start on this machine, file and thread count that loads the target twice
        if (backend == "auto" and not isinstance(model, LoadedModel) and self.target.backend == "llamacpp"
                and spec.method != "none" and not self.target.model.batch_invariant):
            log.info("backend auto: llama.cpp's kernels for %s's weight types are not batch-invariant, so method %s "
                     "runs on torch, where its greedy output is identical to plain decoding (--backend llamacpp "
                     "runs it on libllama, identical up to that rounding); loading it there (later starts read "
                     "the check from the start-up cache and load once)", self.target.name, spec.method)
            t0 = time.perf_counter()
            try:
                self.target = load_model(model, device, dtype, "model", quantization, kv_cache_dtype, "torch")
                self.backend_reason = NOT_INVARIANT.format(method=spec.method)
            except ConfigError as e:        # leaplm's forward cannot run the file: it stays on libllama, labelled
                log.warning("backend auto: %s stays on libllama (identical up to its batch variance): %s",
                            self.target.name, e)
            self.startup.load_s += time.perf_counter() - t0
        self.draft: LoadedModel | None = None
        if spec.method == "draft":
            t0 = time.perf_counter()
            src = draft if draft is not None else spec.draft
            self.draft = src if isinstance(src, LoadedModel) else load_model(
                src, draft_device or device, dtype, "draft",
                draft_quantization(choice.quantization or quantization, src), backend=draft_backend(backend))
            check_vocab(self.target, self.draft)
            self.startup.draft_s = time.perf_counter() - t0
        if max_num_batched_tokens is not None and (not isinstance(max_num_batched_tokens, int)
                                                   or isinstance(max_num_batched_tokens, bool)
                                                   or max_num_batched_tokens < 1):
            raise ConfigError("max_num_batched_tokens", f"must be an integer >= 1, got {max_num_batched_tokens!r}")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.backend = self.target.backend
        # what speculation promises here: libllama on weight types whose block kernels round differently from its
        # one-token kernels (LlamaCppLM.batch_invariant) keeps greedy identity only up to that rounding
        t_checks = time.perf_counter()
        self.exactness = exactness_of(self.target)
        self.startup.checks_s += time.perf_counter() - t_checks
        self.tokenizer = self.target.tokenizer
        self.model = self.target.model
        log.info("backend: %s for %s%s (speculation: %s; why: %s)", self.backend, self.target.name,
                 f", {self.draft.backend} for the draft {self.draft.name}" if self.draft is not None else "",
                 self.exactness, self.backend_reason)
        self.max_model_len = resolve_max_model_len(max_model_len, self.model.max_len, self.target.name)
        if self.draft is not None and self.draft.model.max_len < self.max_model_len:
            # the draft must see every committed token: past its positions it would fail mid-request
            log.warning("draft %s has a context of %d positions, shorter than %d: requests are limited to %d",
                        self.draft.name, self.draft.model.max_len, self.max_model_len, self.draft.model.max_len)
            self.max_model_len = self.draft.model.max_len
        self._factories: dict[str, Callable[[int], Proposer] | None] = {"none": None}
        self._factories_lock = threading.Lock()
        self._grammar_vocab: GrammarVocab | None = None   # built by the first constrained request
        self.proposer_factory(spec.method)        # fails here, naming the field, if the method cannot run
        self.estimates = Estimates()              # the one cost calibration, shared by every batch
        # acceptance priors shared with the process's other engines of this target and proposer; the first
        # request starts from the draft's card (kpolicy/priors.py)
        self.estimates.method_acceptance = shared((self.target.path, self.draft.path if self.draft else spec.head))
        self.estimates.card = card_acceptance(self.draft.path) if self.draft is not None else {}
        self._batch: Batch | None = None
        self._batch_busy = False
        # torch's threads against one thread: a warning when other work makes more threads slower (its docstring)
        t_checks = time.perf_counter()
        self.thread_check = cached_check_threads(self)
        if spec.method != "none" and spec.adaptive_k:
            cached_calibrate(self, max_rows=1, ctx=64, repeats=3)
        self.startup.checks_s += time.perf_counter() - t_checks

    # --- public API ------------------------------------------------------------------------------------------
    def generate(self, prompt: PromptInput | PreparedRequest,
                 params: SamplingParams | None = None) -> GenerationOutput:
        """Generate a continuation of prompt: text, token ids or chat messages ([{role, content}, ...], through the
        model's chat template); prepared by engine/prepare.py like every other caller's."""
        req = self.prepare(prompt, params)
        return self._output(list(self._run(req)), req.params, req.ids)

    def generate_batch(self, prompt: PromptInput, params: list[SamplingParams]) -> list[GenerationOutput]:
        """len(params) sequences of the same prompt (`leaplm generate --samples N`: sample i with seed + i), run as
        the rows of one batch through the one step: one batched target forward per step for all of them. A model
        without batched forwards runs them one after another, each a batch of one."""
        if not isinstance(params, (list, tuple)) or not 1 <= len(params) <= MAX_SAMPLES:
            raise ConfigError("samples", f"give 1 to {MAX_SAMPLES} SamplingParams, got "
                                         f"{len(params) if isinstance(params, (list, tuple)) else params!r}")
        first = self.prepare(prompt, params[0])
        ids = first.ids
        reqs = [first] + [self.prepare(ids, sp) for sp in params[1:]]
        if len(params) == 1 or not self.model.capabilities.batch:
            return [self._output(list(self._run(r)), r.params, ids) for r in reqs]
        for sp in params:
            self._calibrate_for(sp)
        batch = Batch(self, len(params))
        chunks: list[list[StreamChunk]] = [[] for _ in params]
        try:
            for i, r in enumerate(reqs):
                batch.join(r.ids, r.params, r.method, r.k, tag=i, adaptive_k=r.adaptive_k)
            while batch.rows:
                for out in batch.step().outputs:
                    if out.error is not None:
                        raise RuntimeError(out.error)
                    if out.chunk is not None:        # None: the row sat the step out (engine/constrain.py)
                        chunks[out.row.tag].append(out.chunk)
        finally:
            while batch.rows:
                batch.remove(len(batch.rows) - 1)
        return [self._output(cs, sp, ids) for cs, sp in zip(chunks, params)]

    @staticmethod
    def _output(chunks: list[StreamChunk], params: SamplingParams, ids: list[int]) -> GenerationOutput:
        last = chunks[-1]
        lps = [lp for c in chunks for lp in (c.logprobs or [])] if params.logprobs is not None else None
        return GenerationOutput("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                                last.finish_reason, last.stats, ids, lps)

    def stream(self, prompt: PromptInput | PreparedRequest,
               params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        return self._run(self.prepare(prompt, params))

    def prepare(self, prompt: PromptInput | PreparedRequest, params: SamplingParams | None = None,
                **settings) -> PreparedRequest:
        """The request as it will run (engine/prepare.py): prompt ids, sampling parameters, method and K resolved
        and validated once. settings: method, k, adaptive_k, prompt_logprobs (the engine's by default). A
        PreparedRequest (given to generate or stream) is taken as it is."""
        if isinstance(prompt, PreparedRequest):
            if params is not None or settings:
                raise ConfigError("params", "a prepared request carries its own parameters; give it alone")
            return prompt
        return prepare(self, prompt, params, **settings)

    def encode(self, prompt: PromptInput, params: SamplingParams) -> list[int]:
        """Prompt to token ids, refusing what cannot run (empty, unknown ids, longer than the context)."""
        ids = prompt_ids(self, prompt)
        check_context(self, ids, params)
        return ids

    def _calibrate_for(self, params: SamplingParams) -> None:
        """A request with a prediction speculates under any method, `none` included: the cost calibration an
        engine of method `none` skipped at start-up is made before its first such request."""
        if params.prediction is not None and self.spec.adaptive_k and 1 not in self.estimates.calibrated_rows:
            cached_calibrate(self, max_rows=1, ctx=64, repeats=3)

    @property
    def kv_cache_peak_bytes(self) -> int:
        """Most bytes the target KV cache of generate/stream has held (it grows with the sequence)."""
        cache = self._batch.cache if self._batch is not None else None
        return cache.peak_nbytes if cache is not None else 0

    # --- the step loop: a batch of one through the one step ---------------------------------------------------
    @property
    def grammar_vocab_built(self) -> bool:
        """Whether llguidance's view of the tokenizer exists (grammar_state then no longer reads the tokenizer)."""
        return self._grammar_vocab is not None

    def grammar_state(self, spec: StructuredOutput) -> GrammarState:
        """A fresh grammar state for a request constrained by spec (llguidance's view of the tokenizer is built on
        the first one, about 0.1-1 s, and kept)."""
        return self.build_grammar_vocab().state(spec)

    def build_grammar_vocab(self) -> GrammarVocab:
        """llguidance's view of the tokenizer, built once (it reads the tokenizer); ConfigError when it cannot be."""
        with self._factories_lock:
            if self._grammar_vocab is None:
                try:
                    self._grammar_vocab = GrammarVocab(self.tokenizer, self.model.vocab_size,
                                                       self.target.eos_token_ids)
                except ValueError as e:
                    raise ConfigError("structured", str(e)) from None
        return self._grammar_vocab

    def proposer_factory(self, method: str) -> Callable[[int], Proposer] | None:
        """The proposer factory for `method` (built once, then shared); ConfigError if it cannot run here."""
        with self._factories_lock:
            if method in self._factories:
                return self._factories[method]
            try:
                spec = dataclasses.replace(self.spec, method=method,
                                           draft=self.draft.name if self.draft is not None else None)
                factory = make_proposer_factory(spec, self.target, self.draft)
            except ConfigError as e:
                if e.field in ("method", "draft") and method != self.spec.method:
                    raise ConfigError("method", f"method {method!r} is not available here: {e.message}") from None
                raise
            self._factories[method] = factory
            return factory

    def forget_history(self) -> None:
        """Drop what proposers remember across requests (the suffix method's history of earlier outputs). A
        benchmark that repeats a prompt calls this before each run: otherwise suffix copies its own earlier
        answer to the same prompt and measures a speedup no new request would see."""
        with self._factories_lock:
            for factory in self._factories.values():
                if factory is not None:
                    factory.forget()

    def _run(self, req: PreparedRequest) -> Iterator[StreamChunk]:
        self._calibrate_for(req.params)
        batch = self._acquire_batch()
        try:
            batch.join(req.ids, req.params, req.method, req.k, req.prompt_logprobs, adaptive_k=req.adaptive_k)
            while batch.rows:
                outcome = batch.step()
                if not outcome.outputs:              # a step that only prefilled a chunk of the prompt
                    continue
                out = outcome.outputs[0]
                if out.error is not None:
                    raise RuntimeError(out.error)
                chunk = out.chunk
                if chunk is not None and (chunk.text or chunk.token_ids or chunk.finish_reason):
                    yield chunk
        finally:
            self._release_batch(batch)

    def _acquire_batch(self) -> Batch:
        """The engine's batch of one, or a fresh one while another stream still holds it (two interleaved
        streams must not share a cache row)."""
        if self._batch is None:
            t0 = time.perf_counter()
            self._batch = Batch(self, 1)
            self.startup.cache_s = time.perf_counter() - t0
        elif self._batch_busy:
            return Batch(self, 1)
        self._batch_busy = True
        return self._batch

    def _release_batch(self, batch: Batch) -> None:
        while batch.rows:                         # a stream closed early: free its row
            batch.remove(len(batch.rows) - 1)
        if batch is self._batch:
            self._batch_busy = False


def exactness_of(target: LoadedModel) -> str:
    """'identical', or on libllama where its kernels are not batch-invariant for this model (LlamaCppLM
    .batch_variance), 'identical up to llama.cpp's batch variance'."""
    if target.backend != "llamacpp" or target.model.batch_invariant:
        return "identical"
    return "identical up to llama.cpp's batch variance"


def check_names(draft, head, backend: str) -> None:
    """A draft and a head given by path or shipped name (`smollm2-draft`, `eagle-smollm2`) are checked before the
    target loads, so a misspelt name fails at once, naming its field and the shipped names."""
    from ..heads.loader import head_dir
    from ..models.loading import check_source

    if isinstance(draft, str):
        check_source(draft, "draft", draft_backend(backend))
    if isinstance(head, str):
        head_dir(head)


def draft_quantization(quantization: str | None, draft: str) -> str | None:
    """The draft gets the target's quantization; 'gguf' (keep a file's own blocks) only when it is a GGUF file,
    else 'int8' (leaplm's kernel on blocks of the draft's own weights): a draft is weight-streaming bound like
    the target, so beside a target on the int8 kernel an fp32 draft would read 4x the bytes per parameter (the
    SmolLM2 draft took ~4 ms a token in fp32 beside a 7 ms target). A draft only proposes: its rounding never
    changes the output."""
    from ..models.gguf import is_gguf

    if quantization == "gguf" and not is_gguf(draft):
        return "int8"
    return quantization


def check_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft must share the target's tokenizer, token for token. Its model may have more or fewer embedding
    rows than the target's (vocabularies padded to a multiple of 64 or 128) as long as both cover every real
    token: the draft proposer masks and cuts the padded rows."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])
        tok = diff[0][0]
        raise ConfigError("draft", f"{draft.name}: its tokenizer ({len(dv)} tokens) disagrees with the target's "
                                   f"({len(tv)} tokens): token {tok!r} is id {tv.get(tok)} in the target, "
                                   f"{dv.get(tok)} in the draft; the draft must share the target's tokenizer")
    real = max(tv.values()) + 1 if tv else 0
    for who, lm in (("target", target), ("draft", draft)):
        if lm.model.vocab_size < real:
            raise ConfigError("draft", f"{lm.name}: the {who} model has {lm.model.vocab_size} vocabulary rows, "
                                       f"fewer than the {real} tokens of the shared tokenizer")

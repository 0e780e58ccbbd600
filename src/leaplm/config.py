"""Typed, validated configuration: what a user may ask of the engine, checked at the boundary.

Every validation error is a ConfigError naming the offending field, so the CLI and the server can turn it
into a clear message (and an HTTP 400) without a traceback.
"""
from __future__ import annotations

import json as _json
import math
import os
from dataclasses import dataclass, field

from .errors import ConfigError  # re-exported: every boundary catches it from here


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(name, message)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# --- structured output -----------------------------------------------------------------------------------------
# What a request's output must match: a JSON Schema (`json`), any JSON object (`json_object`), a regular expression
# (`regex`), one string of a list (`choice`), or a grammar (`grammar`: Lark in llguidance's dialect, or GBNF, told
# apart by its `::=` rules). llguidance compiles each into one grammar; a spec that does not compile is refused here
# with the library's reason, and so is a JSON Schema keyword llguidance does not implement (it names it: never
# silently ignored). JSON is written with fixed separators (", " between items, ": " after a key) and no other
# whitespace outside strings: the grammar then forces every separator, key and closing bracket, and those tokens are
# drafted for free (structured/state.py). A schema may choose other separators through llguidance's "x-guidance" key.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutput:
    """Exactly one of the fields below is set. Errors name the field as `structured.<field>`."""

    json: dict | str | None = None
    """A JSON Schema (an object, or its JSON text): the output is one JSON value valid against it."""
    json_object: bool = False
    """The output is any JSON object."""
    regex: str | None = None
    """The output matches this regular expression in full (Rust regex syntax, as llguidance reads it)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: Lark (llguidance's dialect, `start:` rule) or GBNF (`root ::= ...`)."""
    compiled: str = field(default="", init=False, repr=False, compare=False)
    """The llguidance grammar all of the above compile to (set by validate)."""

    MAX_TEXT = 1 << 20          # characters of a schema, regex or grammar
    MAX_CHOICES = 4096

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if (getattr(self, k) is not None and getattr(self, k) is not False))

    def validate(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise ConfigError("structured", f"set exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                                            f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        name = f"structured.{kind}"
        try:
            grammar = self._grammar(kind, name)
        except RecursionError:
            raise ConfigError(name, "nested too deeply to compile") from None
        except ValueError as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(name, str(e)) from None
        import llguidance as llg

        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error or messages:
            # a warning means llguidance would approximate or ignore part of it (an unknown format, say)
            raise ConfigError(name, "; ".join(m.strip() for m in messages) or "not accepted by llguidance")
        self.compiled = grammar

    def _grammar(self, kind: str, name: str) -> str:
        """The llguidance grammar text of the one field set (kind)."""
        import llguidance as llg

        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                _check_text_size(schema, name)
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise ConfigError(name, f"not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ConfigError(name, f"a JSON Schema must be an object, got {type(schema).__name__}")
            try:
                text = _json.dumps(schema, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ConfigError(name, f"not JSON-serialisable: {e}") from None
            _check_text_size(text, name)
            self.json = schema
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            if self.json_object is not True:
                raise ConfigError(name, f"must be true or false, got {self.json_object!r}")
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ConfigError(name, "must be a non-empty string")
            _check_text_size(self.regex, name)
            grammar = llg.LLMatcher.grammar_from_regex(self.regex)
        elif kind == "choice":
            c = self.choice
            if not isinstance(c, (list, tuple)) or not c or not all(isinstance(s, str) and s for s in c):
                raise ConfigError(name, "must be a non-empty list of non-empty strings")
            if len(c) > self.MAX_CHOICES:
                raise ConfigError(name, f"at most {self.MAX_CHOICES} choices, got {len(c)}")
            self.choice = list(c)
            _check_text_size("".join(c), name)
            # Lark string literals take JSON's escapes
            grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(_json.dumps(s) for s in c))
        else:
            g = self.grammar
            if not isinstance(g, str) or not g.strip():
                raise ConfigError(name, "must be a non-empty string")
            _check_text_size(g, name)
            if "::=" in g:
                from llguidance.gbnf_to_lark import gbnf_to_lark
                try:
                    g = gbnf_to_lark(g)
                except Exception as e:  # noqa: BLE001 - the converter's own parse errors, whatever their type
                    raise ConfigError(name, f"invalid GBNF grammar: {e}") from None
            grammar = llg.LLMatcher.grammar_from_lark(g)
        return grammar


def _check_text_size(text: str, name: str) -> None:
    if len(text) > StructuredOutput.MAX_TEXT:
        raise ConfigError(name, f"at most {StructuredOutput.MAX_TEXT} characters, got {len(text)}")


@dataclass
class SamplingParams:
    """How to sample one request. Every field keeps the output distribution exactly the target's under
    every speculative method: the processors below are applied identically to the target's p at each
    verified position (with the draft tokens before it counted as context), and the proposer's q is
    whatever the proposer sampled from. Nothing here is approximated under speculation."""

    max_new_tokens: int = 128
    """Tokens to generate at most (>= 1); a step that accepts several tokens is cut to this exactly."""
    temperature: float = 1.0
    """0 means greedy (argmax, no random draws); > 0 scales logits by 1/temperature. Below GREEDY_BELOW (1e-5, as
    vLLM) sampling is greedy: the distribution there is the argmax's to within float precision anyway."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling: smallest set with cumulative probability >= top_p, in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty (> 0) on tokens already in prompt or output; 1 disables."""
    seed: int | None = None
    """Seed of this request's torch.Generator; None draws one from the OS."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; the stop string itself is not returned."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (in addition to EOS unless ignore_eos); the token is not returned."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    logprobs: int | None = None
    """Return the target's log-probability of each generated token and this many top alternatives
    (0..20); None returns none. Computed from the target's raw logits, so exact under speculation."""
    verifier: str = "auto"
    """How a sampled request's drafts are verified (a greedy one's: always against the argmax), one of VERIFIERS;
    all are lossless. 'rejection': speculative rejection sampling, a draft token x kept with probability
    min(1, p(x) / q(x)), the most any verifier keeps (1 - TV(p, q) per token); 'race': the exponential race, which
    keeps a draft token when it equals the target's own sample under the seed's per-position exponentials (fewer
    kept, but the output is a function of the seed alone, the same whatever K and batch); 'auto': the race for
    seeded requests and for trees of sampling proposers (eagle, medusa: their candidates are drawn by the race),
    rejection sampling otherwise."""
    prediction: str | dict | None = None
    """Predicted Outputs (OpenAI's `prediction`): text the output is expected to repeat in large part (the file
    an edit rewrites, the paragraph a proofreading returns). Its tokens are drafted where the output follows it
    (propose/prediction.py), ahead of the request's own method, and verified like any draft, so the output is
    the same with or without it. A string, or OpenAI's {"type": "content", "content": STRING | [{"type": "text",
    "text": STRING}, ...]}; normalised to the string by validate. Empty: no prediction."""
    structured: StructuredOutput | None = None
    """Constrain the output to a JSON Schema, any JSON object, a regex, a list of choices or a grammar
    (structured/spec.py). The target's p at every verified position is masked by the grammar before verification,
    so the output is distributed as the constrained target's under every method; None: unconstrained."""

    VERIFIERS = ("auto", "rejection", "race")
    MAX_TEMPERATURE = 100.0
    GREEDY_BELOW = 1e-5          # a temperature below this is greedy (see temperature)
    MAX_NEW_TOKENS = 1 << 20
    MAX_STOP = 16
    MAX_LOGPROBS = 20
    MAX_PREDICTION_CHARS = 1 << 20

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW

    def validate(self) -> None:
        m = self.max_new_tokens
        _check(_is_int(m) and 1 <= m <= self.MAX_NEW_TOKENS, "max_new_tokens",
               f"must be an integer in [1, {self.MAX_NEW_TOKENS}], got {m!r}")
        t = self.temperature
        _check(_is_real(t) and math.isfinite(t) and 0 <= t <= self.MAX_TEMPERATURE, "temperature",
               f"must be a finite number in [0, {self.MAX_TEMPERATURE}], got {t!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be an integer >= 0, got {self.top_k!r}")
        p = self.top_p
        _check(_is_real(p) and 0 < p <= 1, "top_p", f"must be in (0, 1], got {p!r}")
        mp = self.min_p
        _check(_is_real(mp) and 0 <= mp <= 1, "min_p", f"must be in [0, 1], got {mp!r}")
        r = self.repetition_penalty
        _check(_is_real(r) and math.isfinite(r) and 0 < r <= 10, "repetition_penalty",
               f"must be in (0, 10], got {r!r}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer or null, got {self.seed!r}")
        _check(self.seed is None or -(1 << 63) <= self.seed < (1 << 64), "seed",   # all 64 bits are used
               f"must be in [-2^63, 2^64), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop), "stop",
               "must be a string or a list of strings")
        _check(len(self.stop) <= self.MAX_STOP, "stop", f"at most {self.MAX_STOP} stop strings, got {len(self.stop)}")
        _check(all(len(s) > 0 for s in self.stop), "stop", "stop strings must not be empty")
        _check(isinstance(self.stop_token_ids, (list, tuple))
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be a list of non-negative integers")
        _check(self.structured is None or isinstance(self.structured, StructuredOutput), "structured",
               f"must be a StructuredOutput or null, got {type(self.structured).__name__}")
        lp = self.logprobs
        _check(lp is None or (_is_int(lp) and 0 <= lp <= self.MAX_LOGPROBS), "logprobs",
               f"must be null or an integer in [0, {self.MAX_LOGPROBS}], got {lp!r}")
        _check(isinstance(self.verifier, str) and self.verifier in self.VERIFIERS, "verifier",
               f"must be one of {', '.join(self.VERIFIERS)}, got {self.verifier!r}")
        self.prediction = prediction_text(self.prediction, self.MAX_PREDICTION_CHARS)


def prediction_text(prediction, max_chars: int = SamplingParams.MAX_PREDICTION_CHARS) -> str | None:
    """OpenAI's `prediction` (or a plain string) -> its text, None when empty. Errors name `prediction` and the
    part at fault (`prediction.type`, `prediction.content[1].text`)."""
    if prediction is None:
        return None
    if isinstance(prediction, dict):
        extra = sorted(set(prediction) - {"type", "content"})
        _check(not extra, f"prediction.{extra[0] if extra else ''}", "unknown field; a prediction has `type` and "
                                                                    "`content`")
        _check(prediction.get("type") == "content", "prediction.type",
               f"must be 'content', got {prediction.get('type')!r}")
        _check("content" in prediction, "prediction.content", "is required")
        content = prediction["content"]
        if isinstance(content, list):
            parts = []
            for i, part in enumerate(content):
                name = f"prediction.content[{i}]"
                _check(isinstance(part, dict), name, f"must be a text part, got {type(part).__name__}")
                _check(part.get("type") == "text", f"{name}.type", f"must be 'text', got {part.get('type')!r}")
                unknown = sorted(set(part) - {"type", "text"})
                _check(not unknown, f"{name}.{unknown[0] if unknown else ''}", "unknown field of a text part")
                _check(isinstance(part.get("text"), str), f"{name}.text",
                       f"must be a string, got {type(part.get('text')).__name__}")
                parts.append(part["text"])
            content = "".join(parts)
        _check(isinstance(content, str), "prediction.content",
               f"must be a string or a list of text parts, got {type(content).__name__}")
        prediction = content
    _check(isinstance(prediction, str), "prediction",
           f"must be a string or {{\"type\": \"content\", \"content\": ...}}, got {type(prediction).__name__}")
    _check(len(prediction) <= max_chars, "prediction", f"at most {max_chars} characters, got {len(prediction)}")
    return prediction or None


MAX_SAMPLES = 128      # sequences of one prompt (Engine.generate_batch, `leaplm generate --samples`)

METHODS = ("none", "draft", "ngram", "suffix", "lookahead", "layerskip", "eagle", "medusa")


@dataclass
class SpecConfig:
    """Which proposer to use and how many tokens it proposes per step."""

    method: str = "draft"
    """One of METHODS; 'none' is plain autoregressive decoding through the same engine."""
    k: int = 5
    """Speculative tokens per step (K >= 1); for tree proposers the number of tree nodes."""
    draft: str | None = None
    """Draft model for method 'draft': a local directory or GGUF file, a hub id, or a shipped draft's name
    (`smollm2-draft`, `draft-1m`; `leaplm models` lists them)."""
    ngram_min: int = 1
    """ngram/suffix: shortest suffix of the context matched."""
    ngram_max: int = 4
    """ngram/suffix: longest suffix of the context matched."""
    window: int = 5
    """lookahead: Jacobi window W (future positions iterated per step)."""
    ngram_size: int = 4
    """lookahead: n-gram size N collected into the pool."""
    guess_set: int = 5
    """lookahead: at most G candidate n-grams verified per step."""
    skip_layers: list[int] | None = None
    """layerskip: layer indices skipped by the draft pass; None chooses them from measured acceptance."""
    skip_confidence: float = 0.5
    """layerskip: stop drafting once the draft's top probability falls below this, in [0, 1) (0 drafts all K;
    the first draft token is always proposed)."""
    corpus: str | None = None
    """suffix: optional file or directory of text whose n-grams seed the static cache."""
    head: str | None = None
    """eagle/medusa: head directory (leaplm, Speculators or EAGLE layout) or a shipped head's name
    (`eagle-smollm2`); None = the head shipped for the target."""
    adaptive_k: bool = True
    """Lower K (to 0) when measured acceptance says speculation costs more than it saves."""
    verifier: str = "auto"
    """The verifier of sampled requests whose SamplingParams.verifier is 'auto' (see there): 'auto', 'rejection'
    or 'race'."""
    forced_tokens: bool = True
    """Structured output: draft the tokens the grammar forces (a JSON key, `": "`, a closing brace) for free, under
    every method and `none`; False decodes them one forward each (the output is the same either way)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(self.method in METHODS, "method", f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        _check(_is_int(self.k) and 1 <= self.k <= 64, "k", f"must be an integer in [1, 64], got {self.k!r}")
        _check(_is_int(self.ngram_min) and self.ngram_min >= 1, "ngram_min", f"must be >= 1, got {self.ngram_min!r}")
        _check(_is_int(self.ngram_max) and self.ngram_max >= self.ngram_min, "ngram_max",
               f"must be >= ngram_min ({self.ngram_min}), got {self.ngram_max!r}")
        _check(self.ngram_max <= 64, "ngram_max", f"must be <= 64, got {self.ngram_max!r}")
        for name, top in (("window", 64), ("ngram_size", 16), ("guess_set", 64)):
            v = getattr(self, name)
            _check(_is_int(v) and 1 <= v <= top, name, f"must be an integer in [1, {top}], got {v!r}")
        if self.method == "lookahead":
            _check(self.ngram_size >= 2, "ngram_size", f"lookahead needs n-grams of 2 tokens or more, got {self.ngram_size}")
        if self.method == "draft":
            _check(self.draft is not None, "draft", "method 'draft' needs a draft model (--draft)")
        if self.skip_layers is not None:
            _check(all(_is_int(i) and i >= 0 for i in self.skip_layers), "skip_layers",
                   "must be a list of non-negative layer indices")
            _check(len(self.skip_layers) > 0, "skip_layers", "must name at least one layer (skipping none would "
                                                             "make the draft the target itself)")
        _check(isinstance(self.forced_tokens, bool), "forced_tokens",
               f"must be true or false, got {self.forced_tokens!r}")
        c = self.skip_confidence
        _check(_is_real(c) and 0 <= c < 1, "skip_confidence", f"must be in [0, 1), got {c!r}")
        _check(isinstance(self.verifier, str) and self.verifier in SamplingParams.VERIFIERS, "verifier",
               f"must be one of {', '.join(SamplingParams.VERIFIERS)}, got {self.verifier!r}")
        if self.head is not None:
            # a path must exist; a bare name is a shipped head's, looked up when the head loads (heads/loader.py)
            _check(isinstance(self.head, str) and bool(self.head.strip()), "head",
                   f"must be a head directory or a shipped head's name, got {self.head!r}")
            bare = "/" not in self.head and os.sep not in self.head and not self.head.startswith((".", "~"))
            _check(bare or os.path.exists(os.path.expanduser(self.head)), "head",
                   f"no such head directory: {self.head!r}")
        if self.corpus is not None:
            _check(isinstance(self.corpus, str) and os.path.exists(self.corpus), "corpus",
                   f"no such file or directory: {self.corpus!r}")


ENGINE_BACKENDS = ("auto", "llamacpp", "torch")


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built from, decided once: the models, the speculation and how they run. Engine(config=...)
    takes it; Engine's keyword arguments, the CLI's engine options (cli/common.EngineOptions) and `leaplm serve`
    build one. Checked here, each error naming its field; the model files are checked when they load."""

    model: object = None
    """Target: a local checkpoint directory or GGUF file, a hub id, a shipped name, or a loaded model
    (models.LoadedModel); None: the embedded target."""
    draft: object = None
    """Draft model for method 'draft' (the same kinds); None: the shipped draft trained for the target, if any."""
    method: str | None = None
    """One of METHODS; None: 'draft' when a draft is known, else 'none'."""
    k: int = 5
    """Most speculative tokens per step (SpecConfig.k)."""
    head: str | None = None
    """eagle/medusa: a head directory or a shipped head's name (SpecConfig.head)."""
    spec: SpecConfig | None = None
    """A whole speculation config, instead of method, k, draft, head and spec_options."""
    spec_options: dict = field(default_factory=dict)
    """SpecConfig's other fields (adaptive_k, ngram_min, window, ...)."""
    backend: str = "auto"
    """What runs a GGUF model's forwards: 'auto' | 'llamacpp' | 'torch' (models/loading.choose_target_backend)."""
    device: str = "cpu"
    """The target's device."""
    draft_device: str | None = None
    """The draft's device; None: the target's."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16 | auto (the checkpoint's)."""
    quantization: str | None = None
    """None | 'int8' | 'int4' | 'gguf' (quant/apply.py), for the target and the draft."""
    kv_cache_dtype: str = "auto"
    """The KV cache's dtype; 'auto' follows dtype."""
    threads: int | None = None
    """torch CPU threads, set when the engine is built (a process-wide setting); None: leave torch's."""
    max_model_len: int | None = None
    """Context (prompt + output) per request; None: min(the model's, 4096)."""
    max_num_batched_tokens: int | None = None
    """Tokens a step may feed the target (longer prompts are prefilled in chunks); None: whole prompts."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(self.backend in ENGINE_BACKENDS, "backend",
               f"must be one of {', '.join(ENGINE_BACKENDS)}, got {self.backend!r}")
        _check(self.threads is None or (_is_int(self.threads) and self.threads >= 1), "threads",
               f"must be an integer >= 1, got {self.threads!r}")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
               "max_model_len", f"must be an integer >= 2, got {self.max_model_len!r}")
        n = self.max_num_batched_tokens
        _check(n is None or (_is_int(n) and n >= 1), "max_num_batched_tokens", f"must be an integer >= 1, got {n!r}")
        _check(self.spec is None or isinstance(self.spec, SpecConfig), "spec",
               f"must be a SpecConfig or None, got {type(self.spec).__name__}")
        _check(isinstance(self.spec_options, dict), "spec_options", "must be a dict of SpecConfig fields")
        if self.spec is not None:
            extra = [n for n, v in (("method", self.method), ("head", self.head)) if v is not None]
            _check(not extra and not self.spec_options, extra[0] if extra else "spec_options",
                   "give it inside spec (a SpecConfig), not beside it")


@dataclass
class ServerConfig:
    """`leaplm serve`: where to listen and how much to take on. Model, draft, method and K are the engine's."""

    host: str = "127.0.0.1"
    """Address to bind; loopback by default (anything else exposes the server to the network)."""
    port: int = 8000
    """TCP port (0 lets the OS choose)."""
    api_key: str | None = None
    """When set, /v1/* requires `Authorization: Bearer <key>` (compared in constant time); /health, /metrics and
    /openapi.json stay open so probes and scrapers need no secret (they expose no request content)."""
    served_model_name: str | None = None
    """The name clients pass as `model`; None uses the --model argument (or 'leaplm-embedded')."""
    max_batch: int = 8
    """Requests decoded together (rows of the batched KV cache)."""
    max_queue: int = MAX_SAMPLES
    """Sequences (prompts x n) waiting beyond the batch rows: a request that would bring the sequences in flight
    (waiting or running) over max_batch + max_queue is refused at once with 429 and Retry-After, one that could
    never fit (more sequences than that) with 400 naming n. The default holds a request of the largest n (128)
    on an idle server, whatever max_batch."""
    max_model_len: int | None = None
    """Context length (prompt + output) per request; None: min(the model's, 4096)."""
    max_body_bytes: int = 4 << 20
    """Largest request body; beyond it 413."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: refuse new requests with 503, let running ones finish for up to this long, then abort them."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header names (no port) the server answers; any other gets 400 (a DNS-rebinding page cannot reach a
    loopback server). None: the loopback names when bound to loopback, no check otherwise; ("*",) allows any."""
    request_read_timeout_s: float = 10.0
    """Longest a client may take to send a whole request (headers and body) from the moment the server waits for
    it; beyond it 408 and the connection is closed (a slowloris cannot hold sockets)."""
    keep_alive_timeout_s: float = 5.0
    """An idle keep-alive connection is closed after this long without a new request."""
    stream_interval_ms: float = 20.0
    """How long a streamed token may be held (this, and the step under way) so that it goes out with the next
    ones, in one wake-up of the event loop and one write to the client's socket: the chunks are the same, the
    first token and the last are never held. 0: every step's tokens are sent at the step's end."""
    kv_cache_bytes: int | None = None
    """KV-cache memory the admitted sequences (waiting or running) may reserve, each prompt + max_tokens tokens:
    a request that can never fit gets 400 naming the field, one that cannot fit now 429 with Retry-After. None:
    no memory gate (the cache grows with the running sequences, at most max_batch x max_model_len tokens)."""
    http_parser: str = "auto"
    """uvicorn's HTTP/1.1 parser: 'httptools' (C), 'h11' (pure Python), or 'auto': httptools when it is installed,
    else h11. Both carry the server's read deadline and OpenAI-shaped errors (server/http_protocol.py)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(isinstance(self.host, str) and bool(self.host), "host", "must be a non-empty address")
        _check(_is_int(self.port) and 0 <= self.port <= 65535, "port", f"must be in [0, 65535], got {self.port!r}")
        _check(self.api_key is None or (isinstance(self.api_key, str) and self.api_key != ""), "api_key",
               "must not be empty")
        _check(_is_int(self.max_batch) and 1 <= self.max_batch <= 256, "max_batch",
               f"must be an integer in [1, 256], got {self.max_batch!r}")
        _check(_is_int(self.max_queue) and 0 <= self.max_queue <= 100_000, "max_queue",
               f"must be an integer in [0, 100000], got {self.max_queue!r}")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
               "max_model_len", f"must be an integer >= 2, got {self.max_model_len!r}")
        _check(_is_int(self.max_body_bytes) and self.max_body_bytes >= 1024, "max_body_bytes",
               f"must be an integer >= 1024, got {self.max_body_bytes!r}")
        _check(_is_real(self.drain_timeout_s) and 0 <= self.drain_timeout_s <= 3600, "drain_timeout_s",
               f"must be in [0, 3600] seconds, got {self.drain_timeout_s!r}")
        for name in ("request_read_timeout_s", "keep_alive_timeout_s"):
            v = getattr(self, name)
            _check(_is_real(v) and math.isfinite(v) and 0.05 <= v <= 3600, name,
                   f"must be in [0.05, 3600] seconds, got {v!r}")
        _check(_is_real(self.stream_interval_ms) and 0 <= self.stream_interval_ms <= 1000, "stream_interval_ms",
               f"must be in [0, 1000] milliseconds, got {self.stream_interval_ms!r}")
        _check(self.kv_cache_bytes is None or (_is_int(self.kv_cache_bytes) and self.kv_cache_bytes >= 1),
               "kv_cache_bytes", f"must be an integer >= 1, got {self.kv_cache_bytes!r}")
        _check(self.http_parser in ("auto", "h11", "httptools"), "http_parser",
               f"must be 'auto', 'h11' or 'httptools', got {self.http_parser!r}")
        if self.http_parser == "httptools":
            import importlib.util

            _check(importlib.util.find_spec("httptools") is not None, "http_parser",
                   "httptools is not installed (pip install httptools), or use 'h11' or 'auto'")
        if self.allowed_hosts is not None:
            if isinstance(self.allowed_hosts, str):
                self.allowed_hosts = tuple(h.strip() for h in self.allowed_hosts.split(",") if h.strip())
            self.allowed_hosts = tuple(self.allowed_hosts)
            _check(len(self.allowed_hosts) > 0 and all(isinstance(h, str) and h and not any(c.isspace() or c in "/@,"
                                                                                          for c in h)
                                                       for h in self.allowed_hosts),
                   "allowed_hosts", f"must be host names without ports (or '*'), got {self.allowed_hosts!r}")

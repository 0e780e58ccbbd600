"""Request planning: a validated request (protocol.py) checked against the model (its tokens against the context)
and turned into its sequences, each prepared by the engine's one request preparation (engine/prepare.py: prompt
ids, sampling parameters, method and K, the same as `leaplm generate` and Engine.generate). Everything a request
asks for is decided here, in one place; the bridge (bridge.py) only submits the plan."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

from ..config import ConfigError, prediction_text
from ..engine.prepare import PreparedRequest, chat_text, prepare, prompt_ids, text_ids
from ..propose.prediction import check_prediction
from .protocol import APIError
from .state import ServerState, max_prompt_chars


@dataclass
class Prompt:
    ids: list[int]
    text: str            # for echo


@dataclass
class Plan:
    """A request as sequences: sequence i is choice i % n of prompt i // n, prepared as it will run (its prompt ids,
    sampling parameters, method, K: engine/prepare.py)."""
    prompts: list[Prompt]
    requests: list[PreparedRequest]   # one per sequence
    n: int                            # choices per prompt
    max_tokens: int                   # tokens each sequence may generate
    max_field: str                    # the field that set it (max_tokens or max_completion_tokens)
    prompt_field: str                 # prompt or messages
    structured_field: str | None = None   # the structured-output field the request set, if any


NOT_PREPARED = object()


def prepare_structured(state: ServerState, body):
    """The request's StructuredOutput (None: unconstrained), its grammar compiled once by llguidance (the row that
    runs it copies that matcher); APIError 400 naming the field for what llguidance refuses. Off the event loop: in
    the grammar pool once llguidance's view of the tokenizer exists (a large grammar's compile then delays no other
    request's tokenizing), else in the tokenize pool (building that view reads the tokenizer).

    What the fields come to, a StructuredOutput or the 400, is kept by their text (state.structured_seen): building
    and checking a grammar takes up to 0.2 s of CPU for a 200 KB schema or grammar, partly holding the GIL, and
    gives the same answer every time (llguidance's limits count work, not time), so a request repeating one pays
    nothing for it. Whatever its answer, a grammar is compiled for each request only when the engine's own cache of
    built grammars (structured/state.py) no longer has it."""
    t0 = time.perf_counter()
    key = structured_key(body)
    seen = state.structured_seen.get(key) if key is not None else None
    if not wants_structure(body):                 # response_format text, or a malformed one: nothing to build
        return _structured(state, body, key, seen)
    result = "miss" if seen is None else "hit"
    try:
        return _structured(state, body, key, seen)
    finally:
        m = state.metrics
        m.grammar_cache.labels(result).inc()
        m.grammar_build.labels(result).observe(time.perf_counter() - t0)


def _structured(state: ServerState, body, key: bytes | None, seen):
    """prepare_structured's work, `seen` what structured_seen kept for `key` (None: nothing)."""
    if isinstance(seen, APIError):
        raise APIError(seen.status, seen.message, seen.param, seen.code)
    if seen is not None:
        state.engine.grammar_state(seen)         # built again only if the engine's own cache let it go
        return seen
    try:
        structured = body.structured_output()
        if structured is not None:
            state.engine.grammar_state(structured)   # the tokenizer can spell it (llguidance's view built first)
    except (ConfigError, ValueError) as e:
        field = e.field if isinstance(e, ConfigError) else structured_field(body)
        message = e.message if isinstance(e, ConfigError) else str(e)
        err = APIError(400, f"{field}: {message}", field, "invalid_value")
        if key is not None:
            state.structured_seen.put(key, err)
        raise err from None
    if key is not None and structured is not None:
        state.structured_seen.put(key, structured)
    return structured


STRUCTURED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                     "response_format")


def structured_key(body) -> bytes | None:
    """A digest of the request's structured-output fields' text (None: they cannot be written as JSON)."""
    try:
        text = json.dumps([getattr(body, n, None) for n in STRUCTURED_FIELDS], ensure_ascii=False, allow_nan=False)
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    except (TypeError, ValueError, RecursionError):
        return None


def wants_structure(body) -> bool:
    """Whether the request sets a structured-output field (other than response_format text)."""
    rf = getattr(body, "response_format", None)
    return any(getattr(body, n, None) is not None for n in ("guided_json", "guided_regex", "guided_choice",
                                                             "guided_grammar", "structured_outputs")) or \
        (isinstance(rf, dict) and rf.get("type", "text") != "text")


def build_grammar_vocab(state: ServerState) -> None:
    """llguidance's view of the tokenizer, built in the tokenize pool (it reads the tokenizer); a tokenizer it
    cannot read is reported by prepare_structured as a 400."""
    try:
        state.engine.build_grammar_vocab()
    except ConfigError:
        pass


def plan_request(state: ServerState, body, chat: bool, structured=NOT_PREPARED) -> Plan:
    """Check what depends on the model (prompt tokens, context, method) and turn the request into its sequences'
    parameters; an APIError (400, naming the field) for what cannot run. Runs in the tokenize pool, off the event
    loop. structured: what prepare_structured returned for body, when it ran already."""
    eng = state.engine
    tok = eng.tokenizer
    L = eng.max_model_len
    limit = max_prompt_chars(state)

    def encode(text: str, field: str) -> list[int]:
        if len(text) > limit:        # before tokenizing: a 4 MB prompt must not occupy the tokenizer for seconds
            raise APIError(400, f"{field}: {len(text)} characters are more than the context of {L} tokens can "
                                f"hold (at most {limit} characters)", field, "context_length_exceeded")
        try:
            return text_ids(eng, text)            # BOS as the tokenizer's configuration says (engine/prepare.py)
        except (UnicodeError, ValueError, TypeError) as e:     # e.g. lone surrogates
            raise APIError(400, f"{field}: cannot be tokenized ({type(e).__name__})", field, "invalid_value") from None

    if chat:
        try:
            text = chat_text(eng, [m.as_dict() for m in body.messages], plain=True)
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
            raise APIError(400, f"messages: the chat template cannot render them ({type(e).__name__}: {e})",
                           "messages", "invalid_value") from None
        prompts = [Prompt(encode(text, "messages"), text)]
        prompt_field = "messages"
        max_tokens = body.requested_max_tokens
        max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        raw = body.prompt
        if isinstance(raw, str):
            raw = [raw]
        elif raw and not isinstance(raw[0], (str, list)):
            raw = [raw]                               # one token-id prompt
        prompts = []
        for p in raw:
            if isinstance(p, str):
                prompts.append(Prompt(encode(p, "prompt"), p))
            else:
                try:
                    ids = prompt_ids(eng, p)
                except ConfigError as e:
                    raise APIError(400, f"prompt: {e.message}", "prompt", "invalid_value") from None
                prompts.append(Prompt(ids, tok.decode(ids)))
        prompt_field, max_field = "prompt", "max_tokens"
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        logprobs = body.logprobs
    for p in prompts:
        if not p.ids:
            raise APIError(400, f"{prompt_field}: the prompt has no tokens", prompt_field, "invalid_value")
        if len(p.ids) >= L:
            raise APIError(400, f"{prompt_field}: the prompt has {len(p.ids)} tokens but the context is {L} tokens "
                                "(prompt + output)", prompt_field, "context_length_exceeded")
    longest = max(len(p.ids) for p in prompts)
    if max_tokens is None:                            # chat default: the rest of the context
        max_tokens = L - longest
    if longest + max_tokens > L:
        raise APIError(400, f"{max_field}: the prompt ({longest} tokens) + {max_field} ({max_tokens}) = "
                            f"{longest + max_tokens} tokens exceed the context of {L} tokens", max_field,
                       "context_length_exceeded")
    check_prediction_field(body.prediction, tok, longest, L, limit)
    n = body.n or 1
    state.admission.check_count(len(prompts) * n, n, prompt_field)    # before preparing up to 16 x 128 sequences
    if structured is NOT_PREPARED:
        structured = prepare_structured(state, body)
    spec = body.speculative
    settings = dict(method=spec.method if spec is not None else None, k=spec.k if spec is not None else None,
                    adaptive_k=spec.adaptive_k if spec is not None else None,
                    prompt_logprobs=logprobs if not chat and body.echo and logprobs is not None else None)
    fields = {"max_new_tokens": max_field, "logprobs": "top_logprobs" if chat else "logprobs",
              "method": "speculative.method", "k": "speculative.k", "adaptive_k": "speculative.adaptive_k",
              "prompt": prompt_field}
    requests = []
    for i in range(len(prompts) * n):
        seed = body.seed + i % n if body.seed is not None else None
        try:
            params = body.sampling_params(max_tokens, logprobs, seed, structured)
            requests.append(prepare(eng, prompts[i // n].ids, params, **settings))
        except ConfigError as e:
            f = fields.get(e.field, e.field)
            raise APIError(400, f"{f}: {e.message}", f, "invalid_value") from None
    return Plan(prompts, requests, n, max_tokens, max_field, prompt_field,
                structured_field(body) if structured is not None else None)


def structured_field(body) -> str:
    """The structured-output field the request set (what a grammar llguidance rejects is named by)."""
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
        if getattr(body, name, None) is not None:
            return name
    return "response_format" if getattr(body, "response_format", None) is not None else "structured_outputs"


def check_prediction_field(prediction, tok, prompt_tokens: int, L: int, limit: int) -> None:
    """`prediction` (APIError 400 naming the field): well formed, and no longer than the context leaves after the
    prompt (its characters checked before it is tokenized)."""
    if prediction is None:
        return
    try:
        if not isinstance(prediction, dict):
            raise ConfigError("prediction", 'must be an object {"type": "content", "content": a string or a list of '
                                            f'text parts}}, got {type(prediction).__name__}')
        text = prediction_text(prediction)
        if text is not None and len(text) > limit:
            raise ConfigError("prediction", f"{len(text)} characters are more than the context of {L} tokens can "
                                            f"hold (at most {limit} characters)")
        check_prediction(tok, text, prompt_tokens, L)
    except ConfigError as e:
        raise APIError(400, f"{e.field}: {e.message}", e.field, "invalid_value") from None

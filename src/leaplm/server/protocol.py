"""The OpenAI wire format as pydantic models, and the mapping from a request to what the engine runs.

Requests are strict: a field of the wrong JSON type (a string for max_tokens, 3.5 tokens, true for n) is an error,
not a conversion; an unknown field is an error (nothing is dropped silently); a known OpenAI field that leaplm
cannot honour exactly (logit_bias, presence/frequency penalties, tools, best_of > n, suffix, response formats
other than text) is refused with a message that says so. Every error becomes an HTTP 400 in OpenAI's shape
{"error": {"message", "type", "param", "code"}} with the offending field in `param` (see app.py).

leaplm extensions (accepted on both endpoints): top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
`speculative: {"method": ..., "k": ...}` (or {"method": "none"}) and stream_options.continuous_usage_stats.
Predicted Outputs: OpenAI's `prediction` (both endpoints), counted in usage.completion_tokens_details.
Structured output: response_format (chat: text, json_object, json_schema) and vLLM's guided_json, guided_regex,
guided_choice, guided_grammar and structured_outputs (both endpoints); structured/requests.py reads them.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from ..config import MAX_SAMPLES, METHODS, SamplingParams, StructuredOutput
from ..models.tokens import chat_prompt as _chat_prompt, plain_chat_prompt as _plain_chat_prompt

MAX_N = MAX_SAMPLES        # choices per request: as Engine.generate_batch and `leaplm generate --samples`
MAX_PROMPTS = 16           # prompts in one completions request
MAX_STOP = SamplingParams.MAX_STOP
MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS
MAX_SEED = 2**63 - 1
ROLES = ("system", "developer", "user", "assistant")

_strict = ConfigDict(strict=True, extra="forbid")
Int = Annotated[int, Field(strict=True)]
Num = Annotated[float, Field(allow_inf_nan=False)]


class APIError(Exception):
    """An error answered in OpenAI's shape: status, message, type, param, code."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.TYPES.get(self.status, "server_error"), self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --- requests ----------------------------------------------------------------------------------------------------
class SpeculativeOptions(BaseModel):
    """leaplm extension: this request's speculation. {"method": "none"} turns it off."""
    model_config = _strict
    method: str = Field(description="Proposer method for this request; 'none' disables speculation (checked, with "
                                    "what this server can run, by the engine's request preparation).",
                        json_schema_extra={"enum": list(METHODS)})
    k: Optional[Annotated[int, Field(strict=True, ge=1, le=64)]] = Field(
        None, description="Most tokens drafted per step for this request (the server's K by default).")
    adaptive_k: Optional[bool] = Field(None, description="false: draft k tokens every step instead of letting the "
                                                         "server's K policy choose (the server's setting by default).")


class StreamOptions(BaseModel):
    model_config = _strict
    include_usage: bool = Field(False, description="Send a last chunk with the usage of the whole request.")
    continuous_usage_stats: bool = Field(False, description="leaplm/vLLM extension: usage so far on every chunk.")


_STOP_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                          {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP},
                          {"type": "null"}]}
_PROMPT_SCHEMA = {"anyOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                             "maxItems": MAX_PROMPTS},
                            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                            {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                                        "minItems": 1}, "minItems": 1, "maxItems": MAX_PROMPTS}]}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def lone_surrogate(data) -> str | None:
    """The path (`messages[0].content`) of the first string holding a lone surrogate in a parsed JSON body, or None.
    The body is written back as UTF-8 first (in C: 0.3 ms for a 100 KB body, where the walk below takes ten times
    that), and walked only when that fails, or when it is nested too deep to write (the walk is iterative: a body
    nested thousands deep is walked without recursion)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, ValueError, TypeError, RecursionError):
        pass
    stack = [(data, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return path or "body"
                stack.append((x, p))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v))
    return None


class TextPart(BaseModel):
    model_config = _strict
    type: Literal["text"]
    text: str


class _Common(BaseModel):
    """Fields both endpoints share."""
    model_config = _strict

    model: str = Field(description="The served model name (GET /v1/models).")
    max_tokens: Optional[Annotated[int, Field(strict=True, ge=1, le=SamplingParams.MAX_NEW_TOKENS)]] = None
    temperature: Optional[Annotated[Num, Field(ge=0, le=SamplingParams.MAX_TEMPERATURE)]] = None
    top_p: Optional[Annotated[Num, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[int, Field(strict=True, ge=0)]] = Field(None, description="leaplm extension; 0 disables.")
    min_p: Optional[Annotated[Num, Field(ge=0, le=1)]] = Field(None, description="leaplm extension.")
    repetition_penalty: Optional[Annotated[Num, Field(gt=0, le=10)]] = Field(None, description="leaplm extension.")
    presence_penalty: Optional[Num] = Field(None, description="Only 0 is supported.")
    frequency_penalty: Optional[Num] = Field(None, description="Only 0 is supported.")
    logit_bias: Optional[dict[str, Any]] = Field(None, description="Not supported (must be empty or null).")
    n: Optional[Annotated[int, Field(strict=True, ge=1, le=MAX_N)]] = None
    stop: Annotated[Any, WithJsonSchema(_STOP_SCHEMA)] = None
    seed: Optional[Annotated[int, Field(strict=True, ge=-MAX_SEED - 1, le=MAX_SEED)]] = Field(
        None, description="Choice i of n samples with seed + i.")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    ignore_eos: Optional[bool] = Field(None, description="leaplm extension.")
    stop_token_ids: Optional[list[Annotated[int, Field(strict=True, ge=0)]]] = Field(
        None, description="leaplm extension.", max_length=MAX_STOP)
    speculative: Optional[SpeculativeOptions] = None
    verifier: Optional[Literal[SamplingParams.VERIFIERS]] = Field(
        None, description="leaplm extension: how sampled drafts are verified ('rejection': rejection sampling, the "
                          "most drafts kept; 'race': the exponential race, output a function of the seed alone; "
                          "'auto', the default: the race with a seed, rejection sampling without). All are "
                          "lossless; greedy requests ignore it.")
    guided_json: Optional[Any] = Field(None, description="vLLM's: a JSON Schema (object or text) the output follows.")
    guided_regex: Optional[str] = Field(None, description="vLLM's: a regular expression the output matches.")
    guided_choice: Optional[list[Any]] = Field(None, description="vLLM's: the output is one of these strings.")
    guided_grammar: Optional[str] = Field(None, description="vLLM's: a grammar (Lark or GBNF) the output follows.")
    structured_outputs: Optional[dict[str, Any]] = Field(
        None, description="vLLM's: one of json, regex, choice, grammar, json_object.")
    prediction: Annotated[Any, WithJsonSchema({"anyOf": [{"type": "object", "properties": {
        "type": {"const": "content"}, "content": {"anyOf": [{"type": "string"}, {
            "type": "array", "items": TextPart.model_json_schema()}]}}, "required": ["type", "content"]},
        {"type": "null"}]})] = Field(
        None, description="Predicted Outputs: {'type': 'content', 'content': text or text parts} the output is "
                          "expected to repeat largely; drafted where the output follows it, verified like any draft "
                          "(the output is the same with or without it). Usage counts accepted and rejected "
                          "prediction tokens.")
    return_token_ids: Optional[bool] = Field(
        None, description="vLLM's: the prompt's token ids (`prompt_token_ids`) and each choice's generated token "
                          "ids (`token_ids`; streamed: each chunk's own) in the response.")

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data):
        """Every string of the body (keys too) must be Unicode text: JSON lets a lone surrogate through
        (`"\\ud800"`), which no tokenizer, grammar compiler or UTF-8 encoder takes; refused naming its field."""
        where = lone_surrogate(data)
        if where is not None:
            raise _field_error(where, "contains a lone surrogate (a \\ud800-\\udfff escape without its pair): "
                                      "not Unicode text")
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return v
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(v)}")
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v not in (None, 0, 0.0):
                raise _field_error(name, "is not supported by leaplm (use repetition_penalty); only 0 is accepted")
        if self.logit_bias:
            raise _field_error("logit_bias", "is not supported by leaplm")
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "is only allowed when stream is true")
        return self

    def structured_output(self) -> StructuredOutput | None:
        """The request's constraint (None: none); a ConfigError naming the request's field when it is bad."""
        from ..structured.requests import from_request

        return from_request(getattr(self, "response_format", None), self.structured_outputs,
                            guided_json=self.guided_json, guided_regex=self.guided_regex,
                            guided_choice=self.guided_choice, guided_grammar=self.guided_grammar)

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed: int | None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """SamplingParams for one choice; validated by SamplingParams itself (the CLI's rules)."""
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0, repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=seed, stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos), logprobs=logprobs, structured=structured,
            verifier=self.verifier or "auto", prediction=self.prediction)


def _field_error(field: str, message: str):
    from pydantic_core import PydanticCustomError

    return PydanticCustomError("leaplm_field", "{field}: {message}", {"field": field, "message": message})


class CompletionRequest(_Common):
    """POST /v1/completions."""
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = Field(
        description="Text, a list of texts, token ids, or a list of token-id lists.")
    echo: Optional[bool] = False
    logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]] = Field(
        None, description="Return the target's log-probabilities with this many alternatives per token.")
    best_of: Optional[Annotated[int, Field(strict=True, ge=1)]] = Field(None, description="Only best_of == n.")
    suffix: Optional[str] = Field(None, description="Not supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("must be a non-empty string, list of strings, list of token ids or list of such lists")
        if all(isinstance(x, str) for x in v):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
            if any(not x for x in v):
                raise ValueError("prompts must not be empty")
            return v
        if all(_is_int(x) for x in v):
            return v
        if all(isinstance(x, list) for x in v):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
            if any(not x or not all(_is_int(t) for t in x) for x in v):
                raise ValueError("token-id prompts must be non-empty lists of integers")
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.suffix:
            raise _field_error("suffix", "is not supported by leaplm")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise _field_error("best_of", "is only supported equal to n (leaplm does not rank samples)")
        return self


class ChatMessage(BaseModel):
    model_config = _strict
    role: str = Field(json_schema_extra={"enum": list(ROLES)})
    content: Annotated[Any, WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "array", "items": TextPart.model_json_schema()}, {"type": "null"}]})] = None
    name: Optional[str] = None

    @field_validator("role")
    @classmethod
    def _role(cls, v):
        if v not in ROLES:
            raise ValueError(f"unsupported role {v!r}; use one of {', '.join(ROLES)}")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        for i, part in enumerate(v):
            if not isinstance(part, dict):
                raise ValueError(f"part {i} must be an object")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"part {i}: content type {kind!r} is not supported (text only)")
            if set(part) - {"type", "text"}:
                raise ValueError(f"part {i}: unknown fields {sorted(set(part) - {'type', 'text'})}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: 'text' must be a string")
        return v

    def as_dict(self) -> dict:
        """{role, content} as a chat template reads it (text parts joined)."""
        return {"role": self.role, "content": self.text()}

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[Annotated[int, Field(strict=True, ge=1, le=SamplingParams.MAX_NEW_TOKENS)]] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)]] = None
    response_format: Optional[dict[str, Any]] = Field(
        None, description="{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': "
                          "{'name': ..., 'schema': {...}, 'strict': true}}.")
    tools: Optional[list[Any]] = Field(None, description="Not supported.")
    tool_choice: Optional[Any] = Field(None, description="Not supported.")
    parallel_tool_calls: Optional[bool] = Field(None, description="Not supported.")

    @model_validator(mode="after")
    def _chat_unsupported(self):
        if self.tools:
            raise _field_error("tools", "tool calling is not supported by leaplm")
        if self.tool_choice not in (None, "none"):
            raise _field_error("tool_choice", "tool calling is not supported by leaplm")
        if self.parallel_tool_calls:
            raise _field_error("parallel_tool_calls", "tool calling is not supported by leaplm")
        if self.top_logprobs is not None and not self.logprobs:
            raise _field_error("top_logprobs", "requires logprobs to be true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise _field_error("max_completion_tokens", "differs from max_tokens; give one of them")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- chat prompt -------------------------------------------------------------------------------------------------
def plain_chat_prompt(messages: list[ChatMessage]) -> str:
    return _plain_chat_prompt([m.as_dict() for m in messages])


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    """The prompt text (models/tokens.chat_prompt): the tokenizer's chat template when it has one, the plain
    template otherwise."""
    return _chat_prompt(tokenizer, [m.as_dict() for m in messages], plain=True)


# --- responses -----------------------------------------------------------------------------------------------------
class SpeculativeUsage(BaseModel):
    """leaplm extension inside usage: this request's speculation figures (summed over its choices)."""
    method: str
    k: int = Field(description="The request's configured K (steps may use less: see /metrics).")
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float = Field(description="accepted / drafted (0 when nothing was drafted).")
    mean_accepted_length: float = Field(description="Tokens emitted per target forward, bonus/recovered included.")
    target_forwards: int


class CompletionTokensDetails(BaseModel):
    """Predicted Outputs' counts (OpenAI's meaning), summed over the request's choices."""
    accepted_prediction_tokens: int = Field(description="Prediction tokens drafted and kept in the output.")
    rejected_prediction_tokens: int = Field(description="Prediction tokens drafted and not kept.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: Optional[CompletionTokensDetails] = None
    speculative: Optional[SpeculativeUsage] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = Field(None, description="With return_token_ids.")
    token_ids: Optional[list[int]] = Field(None, description="With return_token_ids.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = Field(None, description="With return_token_ids.")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None
    prompt_token_ids: Optional[list[int]] = Field(None, description="With return_token_ids.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "leaplm"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def finite(x: float) -> float:
    """JSON has no NaN/inf: clamp a -inf logprob to the most negative finite float."""
    return x if math.isfinite(x) else -3.4e38

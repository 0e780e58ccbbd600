"""Request preparation: what a caller asks for becomes one frozen PreparedRequest, decided once.

A prompt comes as text, token ids or chat messages; `prompt_ids` turns each into token ids the same way for every
caller (Engine.generate / stream / generate_batch, `leaplm generate`, the server's planning):

  text      tokenized without the tokenizer's special tokens, then BOS prepended when the tokenizer's configuration
            adds one (models/tokens.encode_prompt: `add_bos_token`, a GGUF file's `tokenizer.ggml.add_bos_token`),
            never twice: a text (or a chat template) that already starts with BOS keeps one
  messages  [{role, content}, ...] through models/tokens.chat_prompt (the model's chat template, the assistant
            turn opened), then as text
  ids       taken as they are (no BOS added), each checked against the vocabulary

`prepare` adds the rest: the sampling parameters, the proposer method (the engine's when the request names none;
refused here, naming `method`, when it cannot run) and K (the engine's when not given; 0 for `none`). What it
returns travels unchanged to the request's row (engine/step.py Batch.join). A new per-request setting is a field
of SamplingParams (config.py) or of PreparedRequest, filled here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

from ..config import ConfigError, SamplingParams, SpecConfig
from ..models.tokens import chat_prompt, encode_prompt
from ..propose.prediction import check_prediction

PromptInput = Union[str, list[int], list[dict]]     # text, token ids, or chat messages {role, content}
MAX_K = 64                                          # SpecConfig.k's bound, for a request's own K too


class PrepareHost(Protocol):
    """What preparation reads of an engine (engine.Engine is one)."""
    tokenizer: object
    target: object                      # LoadedModel: bos_id, name
    model: object                       # vocab_size
    spec: SpecConfig                    # the default method, K and adaptive_k
    max_model_len: int

    def proposer_factory(self, method: str): ...


@dataclass(frozen=True)
class PreparedRequest:
    """One sequence to generate, every setting resolved and validated (see the module docstring)."""
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    method: str                         # the proposer method, resolved ('none': plain decoding)
    k: int                              # most tokens drafted per step (0 for 'none')
    adaptive_k: bool | None = None      # False: draft k every step; None: the engine's K policy decides
    prompt_logprobs: int | None = None  # return prompt-token logprobs with this many alternatives

    @property
    def ids(self) -> list[int]:
        return list(self.prompt_ids)


def is_chat(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def text_ids(host: PrepareHost, text: str) -> list[int]:
    """Token ids of prompt text: BOS as the tokenizer's configuration says, never twice."""
    return encode_prompt(host.tokenizer, text, host.target.bos_id)


def chat_text(host: PrepareHost, messages: list[dict], plain: bool = False) -> str:
    """The prompt text of chat messages (models/tokens.chat_prompt; `plain`: the plain template without one)."""
    return chat_prompt(host.tokenizer, messages, host.target.name, plain=plain)


def prompt_ids(host: PrepareHost, prompt: PromptInput, field: str = "prompt") -> list[int]:
    """Token ids of a prompt given as text, token ids or chat messages; ConfigError(field) for what cannot run."""
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError(field, "must not be empty")
        ids = text_ids(host, prompt)
    elif is_chat(prompt):
        ids = text_ids(host, chat_text(host, list(prompt)))
    else:
        ids = list(prompt)
        V = host.model.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            raise ConfigError(field, f"token ids must be integers in [0, {V}) (the vocabulary), got {bad[:5]}")
    if not ids:
        raise ConfigError(field, "must not be empty")
    return ids


def check_context(host: PrepareHost, ids: list[int], params: SamplingParams) -> None:
    """The prompt and its output fit the context; so does a prediction (SamplingParams.prediction)."""
    if len(ids) + params.max_new_tokens > host.max_model_len:
        raise ConfigError("max_new_tokens", f"prompt ({len(ids)} tokens) + max_new_tokens "
                                            f"({params.max_new_tokens}) exceed the context of {host.max_model_len}")
    check_prediction(host.tokenizer, params.prediction, len(ids), host.max_model_len)


def prepare(host: PrepareHost, prompt: PromptInput, params: SamplingParams | None = None, *,
            method: str | None = None, k: int | None = None, adaptive_k: bool | None = None,
            prompt_logprobs: int | None = None, field: str = "prompt") -> PreparedRequest:
    """The one preparation of a request (module docstring). ConfigError naming the field for anything that
    cannot run: the prompt (`field`), max_new_tokens against the context, method, k, adaptive_k."""
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ConfigError("params", f"must be a SamplingParams, got {type(params).__name__}")
    ids = prompt_ids(host, prompt, field)
    check_context(host, ids, params)
    method, cap = resolve_method(host, method, k)
    if adaptive_k is not None and not isinstance(adaptive_k, bool):
        raise ConfigError("adaptive_k", f"must be true, false or null, got {adaptive_k!r}")
    if prompt_logprobs is not None and not (isinstance(prompt_logprobs, int) and not isinstance(prompt_logprobs, bool)
                                            and 0 <= prompt_logprobs <= SamplingParams.MAX_LOGPROBS):
        raise ConfigError("prompt_logprobs", f"must be null or an integer in [0, {SamplingParams.MAX_LOGPROBS}], "
                                             f"got {prompt_logprobs!r}")
    return PreparedRequest(tuple(ids), params, method, cap, adaptive_k, prompt_logprobs)


def resolve_method(host: PrepareHost, method: str | None, k: int | None) -> tuple[str, int]:
    """(method, K) of a request: the engine's where not given; ConfigError('method') when the method cannot run
    here (engine.proposer_factory: the one lookup of the method table), ConfigError('k') for a K out of range."""
    method = method if method is not None else host.spec.method
    if not isinstance(method, str):
        raise ConfigError("method", f"must be a method name, got {method!r}")
    factory = host.proposer_factory(method)
    if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_K):
        raise ConfigError("k", f"must be an integer in [1, {MAX_K}], got {k!r}")
    if factory is None:
        return method, 0
    return method, k if k is not None else host.spec.k

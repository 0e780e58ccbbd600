"""The OpenAI-compatible HTTP server: FastAPI routes over one BatchScheduler.

  POST /v1/completions, POST /v1/chat/completions, GET /v1/models    (API key required when one is set)
  GET /health     200 once the model is loaded and warmed up; 503 while loading, draining or failed
  GET /metrics    Prometheus text format
  GET /openapi.json

Request path: validate (protocol.py; every failure a 400 naming the field) -> tokenize and check the context ->
one SeqRequest per (prompt, choice) submitted to the scheduler at once (429 over max_queue) -> outputs come back
from the scheduler thread through loop.call_soon_threadsafe into an asyncio.Queue per HTTP request. A watcher
task waits for the client's http.disconnect; when it comes (streaming or not) every sequence of the request is
aborted, and the scheduler frees their rows at its next step boundary.

Draining (SIGTERM, see runner.py): new requests get 503, /health turns 503, running requests finish for up
to drain_timeout_s, then the rest are aborted and the process exits.
"""
from __future__ import annotations

import asyncio
import hmac
from concurrent.futures import ThreadPoolExecutor
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import ConfigError, SamplingParams, ServerConfig
from ..engine.scheduler import BatchScheduler, QueueFull, SchedulerClosed, SeqOutput, SeqRequest
from ..engine.stats import GenerationStats
from . import hosts
from .admission import Admission
from . import streaming as S
from .hosts import default_allowed_hosts
from .metrics import ServerMetrics
from .protocol import (PLAIN_TEMPLATE_DOC, APIError, ChatCompletionRequest, ChatCompletionResponse,
                       CompletionRequest, CompletionResponse, ErrorResponse, ModelList, chat_prompt, error_body)

log = logging.getLogger(__name__)

DESCRIPTION = f"""OpenAI-compatible serving with lossless speculative decoding and continuous batching.

**Authentication.** With `--api-key`, every `/v1/*` route needs `Authorization: Bearer <key>` (401 otherwise).
`/health`, `/metrics` and `/openapi.json` stay open: probes and scrapers need no secret, and none of them exposes
request content.

**Chat prompts.** The tokenizer's chat template when it has one. {PLAIN_TEMPLATE_DOC}

**Extensions.** `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`speculative: {{"method": ..., "k": ...}}` (`{{"method": "none"}}` turns speculation off for the request),
`stream_options.continuous_usage_stats`; every `usage` carries a `speculative` object with the request's
draft tokens, accepted tokens, acceptance rate and mean accepted length.

**Errors** have OpenAI's shape `{{"error": {{"message", "type", "param", "code"}}}}`: 400 for invalid input (the
field in `param`), 401 bad or missing key, 404 unknown model, 413 body too large, 429 queue full (with
`Retry-After`), 503 loading or shutting down."""

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


@dataclass
class ServerState:
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    engine: object | None = None
    scheduler: BatchScheduler | None = None
    admission: Admission | None = None
    token_text: S.TokenText | None = None
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    load_error_is_input: bool = False   # the load failed on bad input (ConfigError): serve exits 2
    created: int = field(default_factory=lambda: int(time.time()))
    max_token_chars: int = 0        # the longest token's text: a prompt longer than this x context never fits
    # Tokenizing (and templating) runs here, off the event loop; one worker, since a fast tokenizer object is not
    # safe to use from several threads at once.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="leaplm-tokenize"))

    def attach(self, engine, scheduler: BatchScheduler) -> None:
        self.engine, self.scheduler = engine, scheduler
        self.token_text = S.TokenText(engine.tokenizer)
        self.max_token_chars = longest_token_chars(engine.tokenizer)
        self.admission = Admission.for_scheduler(scheduler, self.config.max_batch, self.config.max_queue,
                                                 self.config.kv_cache_bytes)
        self.metrics.bind(scheduler, self.admission)
        scheduler.observer = self.metrics


def build_scheduler(engine, config: ServerConfig) -> BatchScheduler:
    """The scheduler over engine, calibrated and warmed up (one short request through every stage)."""
    rows = config.max_batch
    if rows > 1 and not getattr(engine.model, "supports_batch", False):   # the transformers fallback
        log.warning("%s runs one sequence per forward: serving with one batch row (requests beyond it queue)",
                    type(engine.model).__name__)
        rows = 1
    sched = BatchScheduler(engine, max_batch=rows, max_queue=max(config.max_queue, 1))
    ids = engine.tokenizer("warm up", add_special_tokens=False)["input_ids"] or [0]
    sched.submit([SeqRequest(ids[: max(1, engine.max_model_len // 2)], SamplingParams(max_new_tokens=4, temperature=0),
                             on_output=lambda out: None)])
    sched.run_until_idle()
    sched.max_queue = config.max_batch + config.max_queue     # a backstop: admission.py counts in flight first
    return sched


def longest_token_chars(tok) -> int:
    """Characters of the vocabulary's longest token string (byte-level and sentencepiece token strings are at
    least as long as the text they stand for), so len(text) > this x n means more than n tokens."""
    return max(1, max((len(t) for t in tok.convert_ids_to_tokens(list(range(len(tok)))) if t), default=1))


def max_prompt_chars(state: ServerState) -> int:
    """Characters beyond which a prompt cannot fit the context, whatever it says (checked before tokenizing)."""
    return state.max_token_chars * state.engine.max_model_len


def create_app(config: ServerConfig, *, load: Callable[[], object] | None = None, engine=None,
               model_name: str = "leaplm", on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """The app. Either `engine` (ready now) or `load` (called in a background thread at startup, so /health
    answers 503 while the model loads)."""
    state = ServerState(config, config.served_model_name or model_name)

    def load_in_background() -> None:
        try:
            eng = engine if engine is not None else load()
            sched = build_scheduler(eng, config)
            state.attach(eng, sched)
            sched.start()
            state.ready = True
            log.info("model %s ready (max_batch=%d, max_queue=%d)", state.model_name, config.max_batch,
                     config.max_queue)
        except ConfigError as e:   # bad input (a path, a file, a config field): one line, no traceback
            state.load_error, state.load_error_is_input = f"--{e.field.replace('_', '-')}: {e.message}", True
            log.error("loading the model failed: %s", state.load_error)
            if on_load_error is not None:
                on_load_error(state.load_error)
        except Exception as e:  # noqa: BLE001 - reported through /health and on_load_error
            log.exception("loading the model failed")
            state.load_error = f"{type(e).__name__}: {e}"
            if on_load_error is not None:
                on_load_error(state.load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine is not None:
            load_in_background()
        else:
            threading.Thread(target=load_in_background, name="leaplm-load", daemon=True).start()
        yield
        if state.scheduler is not None:
            await asyncio.to_thread(state.scheduler.stop)
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="leaplm", version=_version(), description=DESCRIPTION, lifespan=lifespan)
    app.state.leaplm = state
    _install_errors(app)
    app.add_middleware(_Guard, state=state)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if state.ready and not state.draining:
            return {"status": "ok"}
        status = "draining" if state.draining else ("failed" if state.load_error else "loading")
        return JSONResponse(error_body(f"server is {status}", "service_unavailable", None, status), 503)

    @app.get("/metrics", response_class=Response)
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models():
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "leaplm",
                "max_model_len": state.engine.max_model_len if state.engine is not None else None}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(state, body, request, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(state, body, request, chat=True)

    _document_auth(app, config)
    return app


def _version() -> str:
    from .. import __version__

    return __version__


# --- errors --------------------------------------------------------------------------------------------------------
def _loc(loc) -> str | None:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 naming the field."""
    e = errors[0]
    kind = e.get("type")
    param = _loc(e.get("loc", ()))
    if kind == "leaplm_field":
        param = e["ctx"]["field"]
        return APIError(400, e["msg"], param, "invalid_value")
    if kind == "json_invalid":
        pos = e.get("loc", ("body", 0))[-1]
        return APIError(400, f"malformed JSON body ({(e.get('ctx') or {}).get('error', 'decode error')} at byte "
                             f"{pos})", None, "invalid_json")
    if param is None:
        if kind == "missing":
            return APIError(400, "the request body is missing; send a JSON object", None, "invalid_json")
        return APIError(400, "the request body must be a JSON object", None, "invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"{param}: unknown field; leaplm does not accept it (nothing is ignored silently)",
                        param, "unknown_field")
    if kind == "missing":
        return APIError(400, f"{param}: field required", param, "missing_field")
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return APIError(400, f"{param}: {msg}", param, "invalid_value")


def _json_error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, headers=err.headers)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _json_error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return _json_error(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(str(exc.detail), kind, None, code), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body("internal server error", "server_error"), 500)


def _document_auth(app: FastAPI, config: ServerConfig) -> None:
    if config.api_key is None:
        return
    base = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = base()
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
                "type": "http", "scheme": "bearer"}
            for path, ops in schema.get("paths", {}).items():
                if path.startswith("/v1/"):
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class _Guard:
    """ASGI middleware before any route: request counting by status, API key (constant-time compare) on /v1/*,
    and the body size limit (413) — a body is read whole (up to the limit) and replayed to the app."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json")

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        key = state.config.api_key
        self.expected = key.encode() if key else None
        cfg = state.config
        self.allowed_hosts = cfg.allowed_hosts if cfg.allowed_hosts is not None else default_allowed_hosts(cfg.host)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.ENDPOINTS else "other"
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            err = self._check_host(scope)
            if err is None:
                err = self._check_auth(scope)
            if err is None and scope["method"] in ("POST", "PUT", "PATCH"):
                err, receive = await self._buffer_body(scope, receive)
            if err is not None:
                await _json_error(err)(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status[0])).inc()

    def _check_host(self, scope) -> APIError | None:
        """DNS rebinding: only the names this server is meant to be reached by (see hosts.py)."""
        if self.allowed_hosts is None:
            return None
        value = None
        for name, v in scope.get("headers", []):
            if name == b"host":
                value = v.decode("latin-1")
                break
        if hosts.allowed(value, self.allowed_hosts):
            return None
        return APIError(400, f"Host header {value!r} is not one this server answers (allowed: "
                             f"{', '.join(self.allowed_hosts)}; see --allowed-hosts)", None, "invalid_host")

    def _check_auth(self, scope) -> APIError | None:
        if self.expected is None or not scope["path"].startswith("/v1/"):
            return None
        got = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                got = value
                break
        scheme, _, token = got.partition(b" ")       # the scheme is case-insensitive (RFC 7235)
        if scheme.lower() != b"bearer":
            token = b""
        if not hmac.compare_digest(token, self.expected):
            return APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", None,
                            "invalid_api_key")
        return None

    async def _buffer_body(self, scope, receive):
        limit = self.state.config.max_body_bytes
        too_big = APIError(413, f"request body exceeds {limit} bytes", None, "request_too_large")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > limit:
                        return too_big, receive
                except ValueError:
                    return APIError(400, "invalid Content-Length header", None, "invalid_request"), receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, _replay(b"", receive, disconnected=True)
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return too_big, receive
            chunks.append(body)
            if not message.get("more_body", False):
                break
        return None, _replay(b"".join(chunks), receive)


def _replay(body: bytes, receive, disconnected: bool = False):
    sent = False

    async def replay():
        nonlocal sent
        if disconnected:
            return {"type": "http.disconnect"}
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()          # after the body: blocks until the client disconnects

    return replay


# --- the request path ----------------------------------------------------------------------------------------------
@dataclass
class _Prompt:
    ids: list[int]
    text: str            # for echo


@dataclass
class _SeqResult:
    """What came back for one sequence (asyncio thread only)."""
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    error: str | None = None
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0


class _Job:
    """One HTTP request: its sequences in the scheduler and what came back for them."""

    DISCONNECTED = object()

    def __init__(self, state: ServerState, prompts: list[_Prompt], params: list[SamplingParams], n: int,
                 method: str | None, k: int | None, prompt_logprobs: int | None,
                 fields: tuple[int, str, str] = (16, "max_tokens", "prompt")):
        self.state = state
        self.prompts, self.n = prompts, n
        self.loop = asyncio.get_running_loop()          # built on the event loop (see _serve)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.seqs = [SeqRequest(prompts[i // n].ids, params[i], on_output=self._sink(i), method=method, k=k,
                                prompt_logprobs=prompt_logprobs) for i in range(len(params))]
        self.results = [_SeqResult() for _ in self.seqs]
        # KV-cache tokens each sequence may grow to, reserved from the admission budget until it finishes
        self.reservations = [len(prompts[i // n].ids) + params[i].max_new_tokens for i in range(len(params))]
        self.released = [True] * len(self.seqs)     # set False once reserved
        self.fields = fields                        # (max_tokens, its field name, the prompt's field name)
        self.open = len(self.seqs)                  # sequences not finished yet
        self.usage_chunk: dict | None = None        # a stream's last chunk with include_usage, set at its end

    def _sink(self, i: int):
        def put(out: SeqOutput) -> None:          # scheduler thread
            if out.finished and not self.released[i]:
                self.released[i] = True
                self.state.admission.release(self.reservations[i])
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, out))
            except RuntimeError:                  # the event loop is gone (shutdown)
                pass
        return put

    def submit(self) -> None:
        """Admit (admission.py: 400 never fits, 429 not now) and queue every sequence, or none."""
        sched, adm = self.state.scheduler, self.state.admission
        max_tokens, max_field, prompt_field = self.fields
        adm.check(sched.sequences_in_flight, self.reservations, [len(p.ids) for p in self.prompts], max_tokens,
                  max_field, prompt_field)
        adm.reserve(sum(self.reservations))
        self.released = [False] * len(self.seqs)
        try:
            sched.submit(self.seqs)
        except (QueueFull, SchedulerClosed) as e:
            self.released = [True] * len(self.seqs)
            adm.unreserve(sum(self.reservations))
            if isinstance(e, SchedulerClosed):
                raise APIError(503, "server is shutting down", None, "shutting_down") from None
            raise APIError(429, f"server busy: {e}; retry later", None, "queue_full",
                           {"Retry-After": str(adm.drain.retry_after(sequences=len(self.seqs)))}) from None
        self.state.metrics.prompt_tokens.inc(sum(len(p.ids) for p in self.prompts) * self.n)

    def abort(self, reason: str = "client disconnected") -> None:
        """Abort every sequence still running (counted as finish reason 'abort'); later outputs are ignored."""
        for seq, res in zip(self.seqs, self.results):
            if res.finish_reason is None and res.error is None:
                self.state.scheduler.abort(seq, reason)
                res.error = reason
                self.state.metrics.finished.labels("abort").inc()

    async def watch(self, request: Request) -> None:
        """Wait for the client to go away, then wake the consumer."""
        try:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    break
        except Exception:  # noqa: BLE001 - a broken channel is a disconnect too
            pass
        self.queue.put_nowait((None, self.DISCONNECTED))

    async def next(self):
        """(index, SeqOutput) of the next output, or None when the client disconnected."""
        i, out = await self.queue.get()
        if out is self.DISCONNECTED:
            return None
        self._record(i, out)
        return i, out

    def _record(self, i: int, out: SeqOutput) -> None:
        res, m = self.results[i], self.state.metrics
        if res.error is not None:               # aborted here already: whatever was in flight does not count
            return
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = out.prompt_logprobs
        c = out.chunk
        if c is not None:
            res.text.append(c.text)
            if c.logprobs:
                res.logprobs.extend(c.logprobs)
            if c.token_ids:
                if res.first_at is None:
                    m.ttft.observe(out.time - self.arrival)
                    res.first_at = out.time
                else:
                    gap = (out.time - res.last_at) / len(c.token_ids)
                    for _ in c.token_ids:
                        m.itl.observe(gap)
                res.last_at = out.time
                res.tokens += len(c.token_ids)
            if c.finish_reason is not None:
                res.finish_reason, res.stats = c.finish_reason, c.stats
                m.e2e.observe(out.time - self.arrival)
                m.finished.labels(c.finish_reason).inc()
        if out.error is not None:
            res.error = out.error
            m.finished.labels("abort" if "disconnect" in out.error or "shutting down" in out.error else "error").inc()
        if out.finished:
            self.open -= 1

    def failure(self) -> APIError | None:
        errors = [r.error for r in self.results if r.error is not None]
        if not errors:
            return None
        if self.state.draining:
            return APIError(503, f"server is shutting down: {errors[0]}", None, "shutting_down")
        return APIError(500, errors[0], None, "engine_error")

    def usage(self) -> dict:
        return S.usage(sum(len(p.ids) for p in self.prompts), [r.stats for r in self.results if r.stats])


async def _serve(state: ServerState, body, request: Request, chat: bool):
    if state.draining:
        raise APIError(503, "server is shutting down", None, "shutting_down")
    if not state.ready:
        raise APIError(503, "the model is still loading" if state.load_error is None else
                       f"the model failed to load: {state.load_error}", None, "not_ready")
    if body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       "model", "model_not_found")
    loop = asyncio.get_running_loop()
    job = _Job(state, *await loop.run_in_executor(state.tokenize_pool, _plan, state, body, chat))
    if body.speculative is not None and body.speculative.adaptive_k is not None:
        for seq in job.seqs:
            seq.adaptive_k = body.speculative.adaptive_k
    job.submit()
    watcher = asyncio.create_task(job.watch(request))
    if body.stream:
        opts = body.stream_options
        gen = _stream_chat(state, job, body) if chat else _stream_completion(state, job, body)
        return StreamingResponse(_guarded(gen, job, watcher, bool(opts and opts.include_usage)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        while job.open:
            if await job.next() is None:
                job.abort()
                return Response(status_code=499)      # nobody is listening any more
    finally:
        watcher.cancel()
        job.abort()
    err = job.failure()
    if err is not None:
        raise err
    return JSONResponse(_chat_response(state, job, body) if chat else _completion_response(state, job, body))


def _plan(state: ServerState, body, chat: bool) -> tuple:
    """Validate what depends on the model (prompt tokens, context, method): the _Job's arguments. Runs in the
    tokenize pool, off the event loop."""
    eng = state.engine
    tok = eng.tokenizer
    L = eng.max_model_len
    V = eng.model.vocab_size
    limit = max_prompt_chars(state)

    def encode(text: str, field: str) -> list[int]:
        if len(text) > limit:        # before tokenizing: a 4 MB prompt must not occupy the tokenizer for seconds
            raise APIError(400, f"{field}: {len(text)} characters are more than the context of {L} tokens can "
                                f"hold (at most {limit} characters)", field, "context_length_exceeded")
        try:
            return tok(text, add_special_tokens=False)["input_ids"]
        except (UnicodeError, ValueError, TypeError) as e:     # e.g. lone surrogates
            raise APIError(400, f"{field}: cannot be tokenized ({type(e).__name__})", field, "invalid_value") from None

    if chat:
        try:
            text = chat_prompt(tok, body.messages)
        except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
            raise APIError(400, f"messages: the chat template cannot render them ({type(e).__name__}: {e})",
                           "messages", "invalid_value") from None
        prompts = [_Prompt(encode(text, "messages"), text)]
        prompt_field = "messages"
        max_tokens = body.requested_max_tokens
        max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        raw = body.prompt
        if isinstance(raw, str):
            raw = [raw]
        elif raw and not isinstance(raw[0], (str, list)):
            raw = [raw]                               # one token-id prompt
        prompts = []
        for p in raw:
            if isinstance(p, str):
                prompts.append(_Prompt(encode(p, "prompt"), p))
            else:
                bad = [t for t in p if not 0 <= t < V]
                if bad:
                    raise APIError(400, f"prompt: token ids must be in [0, {V}) (the vocabulary), got {bad[:5]}",
                                   "prompt", "invalid_value")
                prompts.append(_Prompt(list(p), tok.decode(p)))
        prompt_field, max_field = "prompt", "max_tokens"
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        logprobs = body.logprobs
        prompt_logprobs = logprobs if body.echo and logprobs is not None else None
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
    n = body.n or 1
    method = k = None
    if body.speculative is not None:
        method, k = body.speculative.method, body.speculative.k
        try:
            state.scheduler.proposer_factory(method)
        except ConfigError as e:
            raise APIError(400, f"speculative.method: {e.message}", "speculative.method", "invalid_value") from None
    params = []
    for i in range(len(prompts) * n):
        seed = body.seed + i % n if body.seed is not None else None
        try:
            params.append(body.sampling_params(max_tokens, logprobs, seed))
        except ConfigError as e:
            f = {"max_new_tokens": max_field, "logprobs": "top_logprobs" if chat else "logprobs"}.get(e.field, e.field)
            raise APIError(400, f"{f}: {e.message}", f, "invalid_value") from None
    return prompts, params, n, method, k, prompt_logprobs, (max_tokens, max_field, prompt_field)


async def _guarded(gen, job: _Job, watcher: asyncio.Task, include_usage: bool):
    """Run a stream generator; whatever ends it (done, client gone, cancelled), abort what is still running."""
    try:
        async for piece in gen:
            yield piece
        if job.open == 0 and job.failure() is None:
            if include_usage and job.usage_chunk is not None:
                yield S.sse(job.usage_chunk)
            yield S.DONE
    finally:
        watcher.cancel()
        job.abort()


def _completion_response(state: ServerState, job: _Job, body: CompletionRequest) -> dict:
    choices = []
    for i, res in enumerate(job.results):
        prompt = job.prompts[i // job.n]
        text = "".join(res.text)
        lp = None
        if body.logprobs is not None:
            offset = 0
            if body.echo:
                lp, offset = S.first_prompt_entry(prompt.ids[0], state.token_text, 0)
                plp, offset = S.completion_logprobs(res.prompt_logprobs or [], state.token_text, offset)
                lp = S.merge_completion_logprobs(lp, plp)
                offset = len(prompt.text)
            glp, _ = S.completion_logprobs(res.logprobs, state.token_text, offset)
            lp = S.merge_completion_logprobs(lp, glp)
        choices.append({"index": i, "text": (prompt.text if body.echo else "") + text, "logprobs": lp,
                        "finish_reason": res.finish_reason})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices, "usage": job.usage()}


def _chat_response(state: ServerState, job: _Job, body: ChatCompletionRequest) -> dict:
    choices = []
    for i, res in enumerate(job.results):
        lp = None
        if body.logprobs:
            lp = {"content": S.chat_logprobs(res.logprobs, state.token_text, body.top_logprobs or 0)}
        choices.append({"index": i, "message": {"role": "assistant", "content": "".join(res.text)},
                        "logprobs": lp, "finish_reason": res.finish_reason})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices, "usage": job.usage()}


def _error_event(err: APIError) -> bytes:
    return S.sse(err.body())


async def _stream_completion(state: ServerState, job: _Job, body: CompletionRequest):
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    offsets = [0] * len(job.results)

    def chunk(i: int, text: str, lp, finish) -> dict:
        d = {"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
             "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}], "usage": None}
        if continuous:
            d["usage"] = _usage_so_far(job, i)
        return d

    if body.echo:
        for i in range(len(job.results)):
            p = job.prompts[i // job.n]
            if body.logprobs is None:         # with logprobs, the prompt goes out with its logprobs (below)
                yield S.sse(chunk(i, p.text, None, None))
            offsets[i] = len(p.text)
    while job.open:
        got = await job.next()
        if got is None:
            return
        i, out = got
        if out.error is not None:
            yield _error_event(job.failure() or APIError(500, out.error))
            yield S.DONE
            return
        lp = None
        if out.prompt_logprobs is not None and body.echo and body.logprobs is not None:
            p = job.prompts[i // job.n]
            first, off = S.first_prompt_entry(p.ids[0], state.token_text, 0)
            rest, _ = S.completion_logprobs(out.prompt_logprobs, state.token_text, off)
            yield S.sse(chunk(i, p.text, S.merge_completion_logprobs(first, rest), None))
        c = out.chunk
        if c is None or not (c.text or c.finish_reason or (body.logprobs is not None and c.logprobs) or continuous):
            continue                          # nothing to show: tokens whose text is still held back
        if body.logprobs is not None and c.logprobs:
            lp, _ = S.completion_logprobs(c.logprobs, state.token_text, offsets[i])
        offsets[i] += len(c.text)
        yield S.sse(chunk(i, c.text, lp, c.finish_reason))
    job.usage_chunk = {"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
                       "choices": [], "usage": job.usage()}


async def _stream_chat(state: ServerState, job: _Job, body: ChatCompletionRequest):
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

    def chunk(i: int, delta: dict, lp, finish) -> dict:
        d = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
             "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}], "usage": None}
        if continuous:
            d["usage"] = _usage_so_far(job, i)
        return d

    for i in range(len(job.results)):
        yield S.sse(chunk(i, {"role": "assistant", "content": ""}, None, None))
    while job.open:
        got = await job.next()
        if got is None:
            return
        i, out = got
        if out.error is not None:
            yield _error_event(job.failure() or APIError(500, out.error))
            yield S.DONE
            return
        c = out.chunk
        if c is None or not (c.text or c.finish_reason or (body.logprobs and c.logprobs) or continuous):
            continue
        lp = None
        if body.logprobs and c.logprobs:
            lp = {"content": S.chat_logprobs(c.logprobs, state.token_text, body.top_logprobs or 0)}
        yield S.sse(chunk(i, {"content": c.text} if c.text or not c.finish_reason else {}, lp, c.finish_reason))
    job.usage_chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                       "choices": [], "usage": job.usage()}


def _usage_so_far(job: _Job, i: int) -> dict:
    prompt = len(job.prompts[i // job.n].ids)
    done = job.results[i].tokens
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

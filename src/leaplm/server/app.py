"""The OpenAI-compatible HTTP server: FastAPI routes over one BatchScheduler.

  POST /v1/completions, POST /v1/chat/completions, GET /v1/models    (API key required when one is set)
  GET /health     200 once the model is loaded and warmed up; 503 while loading, draining or failed
  GET /metrics    Prometheus text format
  GET /openapi.json

Request path, one module per stage: middleware.py (Host, API key, body size) -> body.py (a large body's JSON
decoded off the event loop) -> protocol.py (validation: every failure a 400 naming the field) -> planning.py
(tokens against the context, the method, each sequence's sampling parameters) -> bridge.py (admission, the
scheduler thread's outputs into asyncio, client disconnects) -> responses.py (JSON or SSE). errors.py maps every
exception onto OpenAI's error shape; state.py holds the engine, its scheduler and readiness.

Draining (SIGTERM, see runner.py): new requests get 503, /health turns 503, running requests finish for up
to drain_timeout_s, then the rest are aborted and the process exits.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..config import ConfigError, ServerConfig
from .body import BodyRoute
from .bridge import Job
from .errors import install_error_handlers
from .middleware import RequestGuard
from ..models.tokens import PLAIN_TEMPLATE_DOC
from .planning import NOT_PREPARED, build_grammar_vocab, plan_request, prepare_structured, wants_structure
from .protocol import (APIError, ChatCompletionRequest, ChatCompletionResponse,
                       CompletionRequest, CompletionResponse, ErrorResponse, ModelList, error_body)
from .responses import (EventStream, chat_response, completion_response, guarded_stream, stream_chat,
                        stream_completion)
from .state import ServerState, build_scheduler

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


def create_app(config: ServerConfig, *, load: Callable[[], object] | None = None, engine=None,
               model_name: str = "leaplm", on_load_error: Callable[[str], None] | None = None,
               freeze_gc: bool = False) -> FastAPI:
    """The app. Either `engine` (ready now) or `load` (called in a background thread at startup, so /health
    answers 503 while the model loads). freeze_gc: once loaded and warmed up, move every object the process holds
    to the collector's permanent generation (for a server that has its process to itself: `leaplm serve`)."""
    state = ServerState(config, config.served_model_name or model_name)

    def load_in_background() -> None:
        try:
            eng = engine if engine is not None else load()
            sched = build_scheduler(eng, config)
            state.attach(eng, sched)
            if freeze_gc:
                # A full collection walks every tracked object (about 300,000 once torch, the libraries and the
                # model are loaded: 0.2-0.3 s on one core of a 2-core machine, holding the GIL, so every running
                # request stalls that long). Serving allocates enough (a 200 KB JSON Schema is 10,000 containers)
                # to set one off every few seconds; frozen, the objects of the load are never walked again.
                gc.freeze()
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
        state.mailbox.close()
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        state.grammar_pool.shutdown(wait=False, cancel_futures=True)
        state.body_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="leaplm", version=_version(), description=DESCRIPTION, lifespan=lifespan)
    app.router.route_class = BodyRoute          # large bodies decoded off the event loop (body.py)
    app.state.leaplm = state
    install_error_handlers(app)
    app.add_middleware(RequestGuard, state=state)

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


async def _serve(state: ServerState, body, request: Request, chat: bool):
    """One completion or chat request: plan it (off the event loop), submit it, answer as JSON or as a stream."""
    if state.draining:
        raise APIError(503, "server is shutting down", None, "shutting_down")
    if not state.ready:
        raise APIError(503, "the model is still loading" if state.load_error is None else
                       f"the model failed to load: {state.load_error}", None, "not_ready")
    if body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       "model", "model_not_found")
    loop = asyncio.get_running_loop()
    structured = NOT_PREPARED
    if wants_structure(body):                     # compiled beside the tokenizing, not in its queue
        if not state.engine.grammar_vocab_built:  # llguidance's view of the tokenizer reads it: in its pool, once
            await loop.run_in_executor(state.tokenize_pool, build_grammar_vocab, state)
        structured = await loop.run_in_executor(state.grammar_pool, prepare_structured, state, body)
    job = Job(state, await loop.run_in_executor(state.tokenize_pool, plan_request, state, body, chat, structured))
    job.submit()
    request.state.ran = True      # from here a 400 may depend on what runs: not one the body alone gets again
    watcher = asyncio.create_task(job.watch(request))
    if body.stream:
        opts = body.stream_options
        gen = stream_chat(state, job, body) if chat else stream_completion(state, job, body)
        return EventStream(guarded_stream(gen, job, watcher, bool(opts and opts.include_usage)),
                           state.metrics.stream_times)
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
    return JSONResponse(chat_response(state, job, body) if chat else completion_response(state, job, body))

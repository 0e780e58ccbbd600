"""Response builders: the JSON body of a finished request, the SSE events of a streaming one (completions and
chat), from what the bridge (bridge.py) collected."""
from __future__ import annotations

import asyncio
import time
import uuid

from starlette.responses import Response

from . import streaming as S
from .bridge import Job
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .state import ServerState


class EventStream(Response):
    """A text/event-stream response whose pieces go straight to the ASGI send, one body message each. Starlette's
    StreamingResponse runs the stream in a task group beside a second disconnect listener, a task switch and a
    few awaits more per piece on the event loop; the Job's watcher (bridge.py) already ends the stream when the
    client goes away."""

    media_type = "text/event-stream"

    def __init__(self, pieces, times=None):
        """times: a metrics.StreamTimes each write's time is added to (stage "write")."""
        self.pieces, self.times = pieces, times
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        times, clock = self.times, time.perf_counter
        async for piece in self.pieces:
            t = clock()
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            if times is not None:
                times.add("write", clock() - t)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def guarded_stream(gen, job: Job, watcher: asyncio.Task, include_usage: bool):
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


def completion_response(state: ServerState, job: Job, body: CompletionRequest) -> dict:
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
        if body.return_token_ids:
            choices[-1].update(prompt_token_ids=prompt.ids, token_ids=res.token_ids)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices, "usage": job.usage()}


def chat_response(state: ServerState, job: Job, body: ChatCompletionRequest) -> dict:
    choices = []
    for i, res in enumerate(job.results):
        lp = None
        if body.logprobs:
            lp = {"content": S.chat_logprobs(res.logprobs, state.token_text, body.top_logprobs or 0)}
        choices.append({"index": i, "message": {"role": "assistant", "content": "".join(res.text)},
                        "logprobs": lp, "finish_reason": res.finish_reason})
        if body.return_token_ids:
            choices[-1]["token_ids"] = res.token_ids
    out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
           "model": state.model_name, "choices": choices, "usage": job.usage()}
    if body.return_token_ids:
        out["prompt_token_ids"] = job.prompts[0].ids
    return out


def _error_event(err: APIError) -> bytes:
    return S.sse(err.body())


async def stream_completion(state: ServerState, job: Job, body: CompletionRequest):
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    offsets = [0] * len(job.results)
    ids = bool(body.return_token_ids)
    first = [True] * len(job.results)         # with return_token_ids, a choice's first chunk has its prompt's ids
    event = S.ChunkEvents(cid, "text_completion", created, state.model_name)

    def chunk(i: int, text: str, lp, finish, token_ids: list[int] | None = None) -> bytes:
        choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
        if ids:
            if first[i]:
                choice["prompt_token_ids"] = job.prompts[i // job.n].ids
                first[i] = False
            choice["token_ids"] = token_ids or []
        return event(choice, _usage_so_far(job, i) if continuous else None)

    if body.echo:
        for i in range(len(job.results)):
            p = job.prompts[i // job.n]
            if body.logprobs is None:         # with logprobs, the prompt goes out with its logprobs (below)
                yield chunk(i, p.text, None, None)
            offsets[i] = len(p.text)
    times, clock = state.metrics.stream_times, time.perf_counter
    while job.open:
        got = await job.next_outputs()        # a step's outputs, every choice's: written at once
        if got is None:
            return
        t = clock()
        events = []
        for i, out in got:
            if out.error is not None:
                err = job.failure() or APIError(500, out.error)
                if err.code in ("engine_error", "grammar_error"):   # the choice ends (finish_reason "error"), then why
                    events.append(chunk(i, "", None, "error"))
                yield b"".join(events) + _error_event(err) + S.DONE
                return
            lp = None
            if out.prompt_logprobs is not None and body.echo and body.logprobs is not None:
                p = job.prompts[i // job.n]
                head, off = S.first_prompt_entry(p.ids[0], state.token_text, 0)
                rest, _ = S.completion_logprobs(out.prompt_logprobs, state.token_text, off)
                events.append(chunk(i, p.text, S.merge_completion_logprobs(head, rest), None))
            c = out.chunk
            if c is None or not (c.text or c.finish_reason or (body.logprobs is not None and c.logprobs)
                                 or continuous or (ids and c.token_ids)):
                continue                      # nothing to show: tokens whose text is still held back
            if body.logprobs is not None and c.logprobs:
                lp, _ = S.completion_logprobs(c.logprobs, state.token_text, offsets[i])
            offsets[i] += len(c.text)
            events.append(chunk(i, c.text, lp, c.finish_reason, c.token_ids))
        if events:
            piece = b"".join(events)
            times.add("serialize", clock() - t)
            yield piece
    job.usage_chunk = {"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
                       "choices": [], "usage": job.usage()}


async def stream_chat(state: ServerState, job: Job, body: ChatCompletionRequest):
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    ids = bool(body.return_token_ids)
    event = S.ChunkEvents(cid, "chat.completion.chunk", created, state.model_name)

    def chunk(i: int, delta: dict, lp, finish, token_ids: list[int] | None = None) -> bytes:
        choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if ids:
            choice["token_ids"] = token_ids or []
        return event(choice, _usage_so_far(job, i) if continuous else None)

    for i in range(len(job.results)):
        if ids:                               # the prompt's ids on the opening chunk (the response's field)
            opening = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                       "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None, "token_ids": []}],
                       "usage": _usage_so_far(job, i) if continuous else None,
                       "prompt_token_ids": job.prompts[0].ids}
            yield S.sse(opening)
        else:
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
    times, clock = state.metrics.stream_times, time.perf_counter
    while job.open:
        got = await job.next_outputs()        # a step's outputs, every choice's: written at once
        if got is None:
            return
        t = clock()
        events = []
        for i, out in got:
            if out.error is not None:
                err = job.failure() or APIError(500, out.error)
                if err.code in ("engine_error", "grammar_error"):
                    events.append(chunk(i, {}, None, "error"))
                yield b"".join(events) + _error_event(err) + S.DONE
                return
            c = out.chunk
            if c is None or not (c.text or c.finish_reason or (body.logprobs and c.logprobs) or continuous
                                 or (ids and c.token_ids)):
                continue
            lp = None
            if body.logprobs and c.logprobs:
                lp = {"content": S.chat_logprobs(c.logprobs, state.token_text, body.top_logprobs or 0)}
            events.append(chunk(i, {"content": c.text} if c.text or not c.finish_reason else {}, lp,
                                c.finish_reason, c.token_ids))
        if events:
            piece = b"".join(events)
            times.add("serialize", clock() - t)
            yield piece
    job.usage_chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                       "choices": [], "usage": job.usage()}


def _usage_so_far(job: Job, i: int) -> dict:
    prompt = len(job.prompts[i // job.n].ids)
    done = job.results[i].tokens
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

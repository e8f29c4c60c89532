"""One generation request end to end: validate, tokenize, queue, then stream SSE or answer once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from moestream.engine.grammar import GrammarError
from moestream.engine.requests import Generation
from moestream.engine.sampling import SamplingParams
from moestream.engine.tools import ToolSession, with_grammar
from moestream.errors import MoestreamError
from moestream.server.access import AccessRecord
from moestream.server.errors import APIError, from_validation
from moestream.server.protocol import ChatRequest, CompletionRequest
from moestream.server.responses import SSE_DONE, Shape, sse
from moestream.server.worker import Busy, Done, Failed, Job, ShuttingDown, Token

if TYPE_CHECKING:
    from moestream.server.state import ServerState

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left


@dataclass
class Pending:
    """A queued job and what answering it needs."""

    job: Job
    shape: Shape
    endpoint: str
    started: float
    access: AccessRecord


async def submit(
    state: ServerState, body: dict[str, Any], chat: bool, started: float, access: AccessRecord
) -> tuple[Pending, bool]:
    """Validate `body`, build the prompt and queue it; returns the pending job and whether to stream.

    Raises:
        APIError: a 4xx for anything wrong with the request, 503 when the queue is full or the server stops.
    """
    req = _validate(state, body, chat)
    unavailable = state.engine.unavailable
    if unavailable is not None:
        raise APIError(503, f"the model cannot be served: {unavailable}", code="engine_unavailable")
    tools, choice = (req.tool_list(), req.choice()) if chat else ([], "none")
    session = await _tool_session(state, tools, choice, req.parallel_tool_calls if chat else True)
    rendered = tools if session is not None else None  # tool_choice none: the tools are not rendered
    if chat:
        ids = await state.prompts.chat(req.template_messages(), req.chat_template_kwargs, rendered)
        max_tokens = state.prompts.budget(len(ids), req.limit(), None, param="messages")
    else:
        ids = await state.prompts.completion(req.prompt)
        max_tokens = state.prompts.budget(len(ids), req.limit(), COMPLETION_DEFAULT_MAX_TOKENS)
    state.prompts.check_bias(req.logit_bias)
    params = _params(req, max_tokens, state.engine.sampling_defaults)
    if session is not None and session.grammar is not None:
        _guarded(lambda: with_grammar(params, session.grammar))
    shape = Shape(
        state.model_id, chat, include_usage=req.include_usage(), logprobs=params.logprobs is not None
    )
    job = Job(
        ids,
        params,
        shape.id,
        asyncio.get_running_loop(),
        cache_prompt=req.cache_prompt,
        tools=rendered,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls if chat else True,
    )
    try:
        state.worker.submit(job)
    except Busy as exc:
        raise APIError(
            503,
            f"the server is busy ({state.worker.queue_size} requests already waiting); "
            f"retry after {exc.retry_after} s",
            code="server_busy",
            headers={"Retry-After": str(exc.retry_after)},
        ) from None
    except ShuttingDown as exc:
        raise APIError(503, str(exc), code="server_shutting_down") from None
    endpoint = "chat" if chat else "completions"
    return Pending(job, shape, endpoint, started, access), req.stream


def _validate(state: ServerState, body: dict[str, Any], chat: bool) -> ChatRequest | CompletionRequest:
    try:
        req = (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc) from None
    if req.model is not None and req.model not in state.model_names:
        raise APIError(
            404,
            f"the model {req.model[:200]!r} is not served here; this server serves {state.model_id!r}",
            param="model",
            code="model_not_found",
        )
    refusal = req.refusal()
    if refusal is not None:
        raise APIError(400, refusal[1], param=refusal[0], code="unsupported_parameter")
    return req


def _params(
    req: ChatRequest | CompletionRequest, max_tokens: int, model_defaults: dict[str, Any]
) -> SamplingParams:
    return _guarded(lambda: req.sampling(max_tokens, model_defaults))


async def _tool_session(
    state: ServerState, tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool
) -> ToolSession | None:
    """Checks the tools against the chat template before the request is queued (the worker builds its
    own session from the same fields)."""
    try:
        return await state.prompts.tool_session(tools, choice, parallel)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None


def _guarded(fn: Any) -> Any:
    """`fn()`, its user errors as a 400: SamplingParams has the last word on values, the grammar engine
    on schemas, the chat template on tools."""
    try:
        return fn()
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    except (ValueError, MoestreamError) as exc:
        raise APIError(400, str(exc), code="invalid_value") from None


def stream(state: ServerState, pending: Pending, request: Request) -> StreamingResponse:
    """The SSE response: text deltas, then a last chunk with usage, timings and moe, then [DONE]."""
    # the background task also cancels a job whose client left before the first chunk was even asked for
    return StreamingResponse(
        _sse(state, pending, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(pending.job.cancel),
    )


async def answer(state: ServerState, pending: Pending, request: Request) -> Response:
    """Wait for the whole generation and answer once; a client that leaves first cancels the job."""
    final = asyncio.ensure_future(_final(state, pending))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending.job.cancel()  # no-op when finished
        gone.cancel()
    if not final.done():  # the client left: nobody reads an answer, and a queued job never runs
        final.cancel()
        state.metrics.requests.labels(pending.endpoint, "499").inc()
        return Response(status_code=499)
    done = final.result()  # raises the APIError of a failed generation
    _record(state, pending, 200, done.gen)
    return JSONResponse(pending.shape.whole(done.gen, done.logprobs, done.tool_calls))


async def _final(state: ServerState, pending: Pending) -> Done:
    first = True
    while True:
        event = await pending.job.events.get()
        if isinstance(event, Failed):
            raise _failure(event)
        if first:
            state.metrics.ttft.labels(pending.endpoint).observe(time.perf_counter() - pending.started)
            first = False
        if isinstance(event, Done):
            return event


async def _sse(state: ServerState, pending: Pending, request: Request) -> AsyncIterator[str]:
    """The event stream; leaving it early (client gone, starlette cancels us) cancels the job. The
    client going away cancels it at once too: a write fails only once the socket's buffers are full,
    which a fast generation fills with hundreds of tokens nobody reads."""
    shape, first, finished = pending.shape, True, False
    gone = asyncio.ensure_future(_disconnected(request))
    gone.add_done_callback(lambda _: pending.job.cancel())
    try:
        opening = shape.opening()
        if opening:
            yield opening
        while True:
            event = await pending.job.events.get()
            if isinstance(event, Failed):
                finished = True
                error = _failure(event)
                state.metrics.requests.labels(pending.endpoint, str(error.status)).inc()
                pending.access.status = error.status
                yield sse(error.body())
                yield SSE_DONE
                return
            if first:
                state.metrics.ttft.labels(pending.endpoint).observe(time.perf_counter() - pending.started)
                first = False
            if isinstance(event, Token):
                chunk = shape.delta(event.piece, event.logprobs, event.tool_calls)
                if chunk is not None:
                    yield chunk
            elif isinstance(event, Done):
                finished = True
                _record(state, pending, 200, event.gen)
                rest = event.logprobs[event.new_logprobs :], event.tool_calls[event.new_calls :]
                yield shape.last(event.gen.piece, event.gen, *rest)
                yield SSE_DONE
                return
    finally:
        gone.cancel()
        pending.job.cancel()
        if not finished:
            state.metrics.requests.labels(pending.endpoint, "499").inc()
            pending.access.status = 499


def _failure(event: Failed) -> APIError:
    if isinstance(event.error, ShuttingDown):
        return APIError(503, str(event.error), code="server_shutting_down")
    return APIError(500, f"generation failed: {event.error}", code="generation_failed")


async def _disconnected(request: Request) -> None:
    # the body has been read, so the next ASGI message can only be the client going away
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _record(state: ServerState, pending: Pending, status: int, gen: Generation) -> None:
    # tokens and finish reasons are counted by the worker (Metrics.generation), for cancelled jobs too
    state.metrics.requests.labels(pending.endpoint, str(status)).inc()
    state.metrics.latency.labels(pending.endpoint).observe(time.perf_counter() - pending.started)
    pending.access.tokens(gen.prompt_tokens, gen.cached_tokens, len(gen.tokens))

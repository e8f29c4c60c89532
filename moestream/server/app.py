"""The FastAPI application: routes, API-key check, body limit and OpenAI-style errors.

    GET  /health                 liveness and queue depth (no API key needed)
    GET  /v1/models              the one served model
    POST /v1/completions         text or token-id prompt
    POST /v1/chat/completions    messages through the tokenizer's chat template
    GET  /metrics                Prometheus text format

No route opens a file named by a request: the model is loaded once at start and a request's `model`
is only compared with the served names.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from moestream.engine.engine import Engine
from moestream.server import generation
from moestream.server.access import AccessLog, access_record
from moestream.server.errors import APIError
from moestream.server.guard import DEFAULT_REQUEST_TIMEOUT, LoopbackHost
from moestream.server.state import ServerOptions, ServerState

log = logging.getLogger("moestream.server")
ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/models": "models",
    "/health": "health",
    "/metrics": "metrics",
}


def create_app(engine: Engine, options: ServerOptions) -> FastAPI:
    """The app serving `engine`; its worker thread runs from startup to shutdown of the app."""
    state = ServerState(engine, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        state.worker.start()
        try:
            yield
        finally:
            state.worker.stop()
            state.prompts.close()

    app = FastAPI(title="moestream", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.include_router(router)
    _install_error_handlers(app, state)
    app.add_middleware(AccessLog)
    app.add_middleware(LoopbackHost, enabled=options.loopback_only)  # outermost: before anything runs
    return app


def _state(request: Request) -> ServerState:
    return request.app.state.server


def require_key(request: Request) -> None:
    """With --api-key, every route but /health needs `Authorization: Bearer KEY`."""
    key = _state(request).options.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "a valid API key is required: send the header 'Authorization: Bearer KEY'",
            code="invalid_api_key",
        )


router = APIRouter()
guarded = [Depends(require_key)]


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine can serve; 503 with the reason when it cannot (closed, or a failed restream
    left it without a streaming setup), so that a load balancer or supervisor sees it. `notices`: what
    the engine said once and serves on with (a checkpoint file replaced on disk: a restart loads it)."""
    state = _state(request)
    worker, reason = state.worker, state.engine.unavailable
    busy = worker.busy
    body = {
        "status": "ok",
        "waiting": worker.waiting,
        "running": busy > 0,
        "slots": worker.slots,  # --parallel: requests that run at once
        "slots_busy": busy,
        "slots_idle": worker.slots - busy,
    }
    notices = state.engine.notices
    if notices:
        body["notices"] = notices
    if reason is not None:
        return JSONResponse({**body, "status": "unavailable", "reason": reason}, status_code=503)
    return JSONResponse(body)


@router.get("/v1/models", dependencies=guarded)
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_id,
                "object": "model",
                "created": state.created,
                "owned_by": "moestream",
                "context_length": state.prompts.context,
            }
        ],
    }


@router.get("/metrics", dependencies=guarded)
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions", dependencies=guarded)
async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


@router.post("/v1/chat/completions", dependencies=guarded)
async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _generate(request: Request, chat: bool) -> Response:
    started = time.perf_counter()
    state = _state(request)
    body = await read_json(request, state.options.max_body, state.options.request_timeout)
    pending, stream = await generation.submit(state, body, chat, started, access_record(request))
    if stream:
        return generation.stream(state, pending, request)
    return await generation.answer(state, pending, request)


async def read_json(request: Request, limit: int, timeout: float = DEFAULT_REQUEST_TIMEOUT) -> dict[str, Any]:
    """The body as a JSON object: application/json only (a web page's form or text/plain POST is no API
    call), refused over `limit` bytes before it is read whole, within `timeout` seconds."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(
            415,
            f"the request body must be JSON sent as Content-Type: application/json (got {kind[:80]!r}; "
            "with curl: -H 'Content-Type: application/json')",
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    try:
        async with asyncio.timeout(timeout):
            raw = await _body(request, limit)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {timeout:g} s", code="request_timeout"
        ) from None
    # a body of megabytes takes tens of milliseconds to parse: not on the event loop
    return await asyncio.to_thread(_parse, raw) if len(raw) > 256 << 10 else _parse(raw)


async def _body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # chunked bodies declare no length
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:  # "\ud800" is valid JSON but no text: tokenizers and our own UTF-8 responses would fail on it
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            400,
            "the request body contains an unpaired surrogate escape, which is not text",
            code="invalid_json",
        ) from None
    return body


def _no_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which are not JSON
    raise ValueError(f"{name} is not JSON")


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than the server's limit of {limit} bytes", code="request_too_large"
    )


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    def count(request: Request, status: int) -> None:
        endpoint = ENDPOINTS.get(request.url.path, "other")  # unknown paths share one label
        state.metrics.requests.labels(endpoint, str(status)).inc()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        count(request, exc.status)
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        count(request, exc.status_code)
        message = "no such endpoint" if exc.status_code == 404 else str(exc.detail)
        return APIError(
            exc.status_code,
            f"{message}: {request.method} {request.url.path}",
            headers=dict(exc.headers or {}),
        ).response()

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        return APIError(400, "the client disconnected while sending the request").response()

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        count(request, 500)
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()

"""One access-log line per request: client, method, path, status, prompt and predicted tokens, time.

    moestream: 127.0.0.1:40312 "POST /v1/chat/completions" 200 prompt 31 (cached 24) predicted 16 812.4 ms

An ASGI middleware wraps the app, so every request is logged once, errors and unknown paths included,
when its response has been sent to the end (a stream: after `[DONE]`). The generation routes fill in
the token counts and, when the client left mid-stream, the status 499.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("moestream.access")
SCOPE_KEY = "moestream.access"


@dataclass
class AccessRecord:
    """What the routes add to a request's log line."""

    prompt_n: int | None = None  # the whole prompt
    cached_n: int = 0  # of which from the prompt cache
    predicted_n: int | None = None
    status: int | None = None  # overrides the HTTP status (499: the client left during a stream)

    def tokens(self, prompt_n: int, cached_n: int, predicted_n: int) -> None:
        self.prompt_n, self.cached_n, self.predicted_n = prompt_n, cached_n, predicted_n


def access_record(request: Request) -> AccessRecord:
    """The record of `request` (a detached one when the middleware is not installed, e.g. in unit tests)."""
    return request.scope.get(SCOPE_KEY) or AccessRecord()


class AccessLog:
    """ASGI middleware writing one INFO line to the `moestream.access` logger per HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = scope[SCOPE_KEY] = AccessRecord()
        start, status = time.perf_counter(), 500  # an exception before any response is a 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if log.isEnabledFor(logging.INFO):
                log.info(
                    "%s", line(scope, record.status or status, record, 1000 * (time.perf_counter() - start))
                )


def line(scope: Scope, status: int, record: AccessRecord, ms: float) -> str:
    """The log line of one request."""
    client: Any = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    path = json.dumps(scope.get("path", "")[:200])[1:-1]  # escaped: a request cannot forge log lines
    tokens = ""
    if record.prompt_n is not None:
        cached = f" (cached {record.cached_n})" if record.cached_n else ""
        tokens = f" prompt {record.prompt_n}{cached} predicted {record.predicted_n}"
    return f'{who} "{scope.get("method", "")} {path}" {status}{tokens} {ms:.1f} ms'

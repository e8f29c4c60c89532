"""What a client cannot get around: a cap on connections, a deadline for each request to arrive, and,
on a loopback server, a Host header that names the loopback.

uvicorn closes a connection that stays idle for 5 s after a response, but one that connects and never
sends a whole request head (a half-open or slowloris client) is kept forever; `limited_protocol` gives
every request a deadline for its head (the body has one in `read_json`) and answers connections past
the cap with 503 at once. `LoopbackHost` refuses requests whose Host is not a loopback name, so that a
web page in a browser on the same machine cannot reach a server without an API key by pointing its own
domain at 127.0.0.1 (DNS rebinding). Imports nothing of the server extra at module level: the CLI reads
its defaults.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_REQUEST_TIMEOUT = 30.0  # seconds for a request's head, and again for its body, to arrive


def is_loopback_host(host: str) -> bool:
    """Whether a Host header value (name or address, with or without a port) names the loopback."""
    name = host.strip().lower()
    if name.startswith("["):  # [::1]:8080
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always the loopback
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class LoopbackHost:
    """ASGI middleware: with `enabled` (the server listens on a loopback address), a request whose Host
    header is not a loopback name gets 400."""

    def __init__(self, app: Any, enabled: bool) -> None:
        self.app, self.enabled = app, enabled

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.enabled and scope["type"] == "http":
            from moestream.server.errors import APIError

            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if host is not None and not is_loopback_host(host):
                error = APIError(
                    400,
                    f"Host {host[:100]!r} is not a loopback name; this server listens on the loopback "
                    "only (use --host and --api-key to serve other machines)",
                    code="invalid_host",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _busy_response() -> bytes:
    from moestream.server.errors import APIError

    body = json.dumps(
        APIError(503, "too many connections to this server; retry later", code="too_many_connections").body()
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"retry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def limited_protocol(max_connections: int, request_timeout: float) -> type:
    """uvicorn's HTTP protocol class with a connection cap and a deadline for every request head."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    busy = _busy_response()

    class LimitedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._deadline: Any = None
            self._seen: Any = None  # the request cycle last seen started
            if len(self.connections) > max_connections:
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(request_timeout, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            """No whole request head arrived in time: close the connection (nothing is running on it)."""
            self._deadline = None
            if self._idle() and not self.transport.is_closing():
                self.transport.close()

        def _idle(self) -> bool:
            cycle = self.cycle
            return cycle is None or (cycle is self._seen and cycle.response_complete)

        def _started(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle is not self._seen and not cycle.response_complete:
                self._seen = cycle
                self._disarm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._started()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._started()  # a pipelined request may have started already
            if self._idle() and not self.transport.is_closing():
                self._arm()  # the next request head has the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return LimitedHTTPProtocol

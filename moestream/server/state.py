"""What the server's routes share: the options, the engine, its worker thread, metrics and prompts."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from moestream.engine.engine import Engine
from moestream.server.guard import DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_TIMEOUT
from moestream.server.metrics import Metrics
from moestream.server.prompts import Prompts
from moestream.server.worker import Worker


@dataclass
class ServerOptions:
    """What `moestream serve` decides besides the engine."""

    model_id: str
    api_key: str | None = None
    max_body: int = 4 << 20
    queue_size: int = 16
    aliases: list[str] = field(default_factory=list)  # other names a request may use for the model
    loopback_only: bool = False  # listening on a loopback address: Host must name the loopback
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT  # seconds for a request's head, and for its body
    max_connections: int = DEFAULT_MAX_CONNECTIONS


class ServerState:
    """Everything the routes share; owns the worker thread (not the engine)."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.engine, self.options = engine, options
        self.model_id = options.model_id
        self.model_names = {options.model_id, *options.aliases}
        self.created = int(time.time())
        batch = getattr(engine, "batch", None)
        slots = batch.slots if batch is not None else 1
        self.metrics = Metrics(
            engine.counters, lambda: self.worker.waiting, lambda: self.worker.busy, slots, batch
        )
        self.worker = Worker(engine, options.queue_size, on_done=self.metrics.generation)
        self.prompts = Prompts(engine, room=lambda: self.worker.queue_size - self.worker.waiting)
        self.loop: asyncio.AbstractEventLoop | None = None

    def begin_shutdown(self) -> None:
        """SIGTERM or SIGINT arrived (called from the signal handler): end running and queued requests
        now, each with an answer, so that the connections close and the server can stop."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.worker.shutdown)

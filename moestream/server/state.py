"""What the server's routes share: the options, the engine, its worker thread, metrics and prompts."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from moestream.engine.engine import Engine
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


class ServerState:
    """Everything the routes share; owns the worker thread (not the engine)."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.engine, self.options = engine, options
        self.model_id = options.model_id
        self.model_names = {options.model_id, *options.aliases}
        self.created = int(time.time())
        self.metrics = Metrics(engine.counters, lambda: self.worker.waiting)
        self.worker = Worker(engine, options.queue_size, on_done=self.metrics.generation)
        self.prompts = Prompts(engine)
        self.loop: asyncio.AbstractEventLoop | None = None

    def begin_shutdown(self) -> None:
        """SIGTERM or SIGINT arrived (called from the signal handler): end running and queued requests
        now, each with an answer, so that the connections close and the server can stop."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.worker.shutdown)

"""The threads that run the model's requests, fed by a bounded FIFO queue of jobs.

Requests never touch the engine directly: the event loop validates and tokenizes, then submits a Job;
the worker runs jobs on its threads, one per slot (`--parallel N`: N threads, their forwards batched by
the engine's `Batcher`, engine/batch.py; one thread otherwise), and hands each token back to the event
loop thread-safely. A job joins the running batch when a thread takes it and leaves it when it ends, at a
token boundary either way. A job whose client has gone is skipped if still queued and stopped within
one token if running (the engine polls `cancelled()` once per token).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moestream.engine.engine import Engine
from moestream.engine.requests import Generation
from moestream.engine.sampling import SamplingParams, TokenLogprob
from moestream.errors import MoestreamError

log = logging.getLogger("moestream.server")


@dataclass
class Token:
    """The engine produced a token; `piece` is the new text that is safe to send (may be empty), with the
    log-probabilities of the tokens new since the last event and the tool calls completed since."""

    piece: str
    n_tokens: int
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Done:
    """The request finished; `gen` is final (done=True). `logprobs` holds every token's (the whole
    response's), of which those from `new_logprobs` on and `tool_calls` from `new_calls` on were in no
    Token event yet."""

    gen: Generation
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    new_logprobs: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    new_calls: int = 0


@dataclass
class Failed:
    """The engine raised; `error` is what it raised."""

    error: BaseException


Event = Token | Done | Failed


class ShuttingDown(MoestreamError):
    """The server is stopping: the request was not run, or was stopped early."""


class Busy(Exception):
    """The queue is full; `retry_after` is a guess, in whole seconds, of when there will be room."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass
class Job:
    """One request for the worker: token ids in, events out through an asyncio queue."""

    ids: list[int]
    params: SamplingParams
    request_id: str
    loop: asyncio.AbstractEventLoop
    cache_prompt: bool = False
    tools: list[dict[str, Any]] | None = None  # rendered into `ids` already; read back from the output
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stop: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Ask the worker to drop or stop this job (safe from any thread)."""
        self.stop.set()

    def emit(self, event: Event) -> None:
        """Called on the worker thread: hand one event to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down and nobody listens
            self.stop.set()


class Worker:
    """Runs jobs on `slots` dedicated threads (the engine's parallel slots: one job a slot at a time);
    at most `queue_size` jobs wait."""

    def __init__(
        self, engine: Engine, queue_size: int = 16, on_done: Callable[[Generation], None] | None = None
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue size must be at least 1, got {queue_size}")
        self.engine = engine
        self.on_done = on_done  # sees every finished generation, cancelled ones too (metrics)
        self.queue_size = queue_size
        # the jobs for the slots' threads; `submit` bounds them: a job an idle slot is about to take is not
        # waiting, however soon its thread wakes
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self._admitted = 0  # jobs submitted that no thread has taken yet
        batch = getattr(engine, "batch", None)
        self.slots = batch.slots if batch is not None else 1
        self.running: dict[int, Job] = {}  # id(job) -> job, one per busy thread
        self._lock = threading.Lock()
        self.closing = False  # set by `shutdown`: no new job is taken, the running one is stopped
        self.mean_seconds = 1.0  # moving average of job durations, for Retry-After
        # torch's thread count is per OS thread under OpenMP: give the worker the one the engine was loaded
        # with
        self._threads = torch.get_num_threads()
        self._pool = [
            threading.Thread(target=self._run, name=f"moestream-worker-{i}", daemon=True)
            for i in range(self.slots)
        ]

    def start(self) -> None:
        for thread in self._pool:
            thread.start()

    @property
    def waiting(self) -> int:
        """Jobs submitted that no idle slot is there to take."""
        with self._lock:
            return max(0, self._admitted - (self.slots - len(self.running)))

    @property
    def busy(self) -> int:
        """Slots running a job."""
        with self._lock:
            return len(self.running)

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise Busy when the queue is full and ShuttingDown when the server is stopping
        (the caller answers 503)."""
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        with self._lock:
            if self._admitted + len(self.running) >= self.slots + self.queue_size:
                raise Busy(self.retry_after())
            self._admitted += 1
            self.jobs.put_nowait(job)

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained by one job (`slots` end one each mean duration): at
        least 1."""
        return max(1, math.ceil(self.mean_seconds / self.slots))

    def shutdown(self) -> None:
        """Stop taking jobs: the running one ends within one token and its client is told why, the queued
        ones are answered at once. Called on the event loop when SIGTERM or SIGINT arrives."""
        self.closing = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self._lock:
                    self._admitted -= 1
                job.cancel()
                job.emit(Failed(ShuttingDown("the server is shutting down")))
        with self._lock:
            for job in self.running.values():
                job.cancel()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running job, fail the queued ones (their clients get an answer) and end the thread."""
        self.shutdown()
        alive = [t for t in self._pool if t.is_alive()]
        for _ in alive:  # one end mark per thread
            self.jobs.put(None)
        end = time.monotonic() + timeout
        for thread in alive:
            thread.join(max(0.0, end - time.monotonic()))

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        while (job := self.jobs.get()) is not None:
            with self._lock:  # taken: no longer admitted, running unless it is not to run
                self._admitted -= 1
                runs = not self.closing and not job.stop.is_set()
                if runs:
                    self.running[id(job)] = job
            if self.closing:
                job.emit(Failed(ShuttingDown("the server is shutting down")))
                continue
            if not runs:
                continue  # its client left while it was queued
            start = time.perf_counter()
            try:
                self._generate(job)
            except Exception as exc:  # the worker must outlive any one request
                log.exception("request %s failed", job.request_id)
                job.emit(Failed(exc))
            finally:
                with self._lock:
                    del self.running[id(job)]
                    self.mean_seconds = 0.8 * self.mean_seconds + 0.2 * (time.perf_counter() - start)

    def _generate(self, job: Job) -> None:
        def cancelled() -> bool:
            return job.stop.is_set() or self.closing

        # every request keeps its KV cache for the next one, as llama-server's slot does; cache_prompt
        # says whether this one reuses the previous request's
        logprobs: list[dict[str, Any]] = []
        calls = 0
        for gen in self.engine.stream(
            job.ids,
            job.params,
            cache_prompt=job.cache_prompt,
            keep_cache=True,
            cancelled=cancelled,
            request_id=job.request_id,
            tools=job.tools,
            tool_choice=job.tool_choice,
            parallel_tool_calls=job.parallel_tool_calls,
        ):
            # the same Generation object grows: read what we need now, before the next token changes it
            sent = len(logprobs)
            logprobs += [self._logprob(entry) for entry in gen.logprobs[sent:]]
            if not gen.done:
                new_calls = [c.openai() for c in gen.tool_calls[calls:]]
                calls = len(gen.tool_calls)
                job.emit(Token(gen.piece, len(gen.tokens), logprobs[sent:], new_calls))
                continue
            if self.on_done is not None:
                self.on_done(gen)
            if gen.finish_reason == "cancelled" and self.closing:
                job.emit(
                    Failed(
                        ShuttingDown(
                            f"the server is shutting down; the generation was stopped after "
                            f"{len(gen.tokens)} tokens"
                        )
                    )
                )
            else:
                every = [c.openai() for c in gen.tool_calls]
                job.emit(Done(gen, logprobs, sent, every, calls))

    def _logprob(self, entry: TokenLogprob) -> dict[str, Any]:
        """A token's log-probability with the text of it and of its alternatives (decoded here, on the
        thread that owns the engine's tokenizer)."""
        return {
            "token": self._text(entry.token),
            "logprob": entry.logprob,
            "top": [(self._text(t), lp) for t, lp in entry.top],
        }

    def _text(self, token: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([token], skip_special_tokens=False) if tok is not None else str(token)

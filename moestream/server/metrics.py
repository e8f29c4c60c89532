"""Prometheus metrics: requests, tokens, latency and time to first token, and the engine's I/O counters.

Each app gets its own registry, so several servers (tests) can live in one process. The expert-cache
counters are read from the engine at scrape time rather than copied after every request, so a scrape
during a long generation already shows its reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from moestream.engine.requests import Generation
from moestream.engine.stats import Counters

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    """Exposes Engine.counters() as Prometheus counters."""

    def __init__(self, counters: Callable[[], Counters]) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        c = self.counters()
        for name, doc, value in (
            ("moestream_expert_cache_hits", "Routed-expert lookups served from the cache.", c.hits),
            (
                "moestream_expert_cache_misses",
                "Routed-expert lookups that had to be read from disk.",
                c.misses,
            ),
            ("moestream_expert_bytes_read", "Bytes of expert weights read from disk.", c.bytes_read),
            ("moestream_expert_read_wait_seconds", "Seconds compute waited for expert reads.", c.read_wait_s),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class _BatchCollector:
    """Exposes the engine's batch rounds (`--parallel` > 1) as Prometheus counters."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def collect(self) -> Iterator[Metric]:
        for name, doc, value in (
            (
                "moestream_decode_steps",
                "Decode steps run for several requests at once.",
                self.batch.decode_steps,
            ),
            (
                "moestream_decode_rows",
                "Tokens those steps decoded (rows / steps: the mean batch).",
                self.batch.decode_rows,
            ),
            (
                "moestream_side_by_side_rounds",
                "Rounds whose decode step and prompt chunks ran a layer at a time side by side.",
                self.batch.together_rounds,
            ),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class Metrics:
    """The server's metrics; `render()` is the /metrics body."""

    def __init__(
        self,
        counters: Callable[[], Counters],
        waiting: Callable[[], int],
        busy: Callable[[], int] = lambda: 0,
        slots: int = 1,
        batch: Any = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "moestream_requests",
            "Requests answered, by endpoint and HTTP status (499: the client left).",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "moestream_generations", "Generations finished, by finish reason.", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("moestream_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generated_tokens = Counter("moestream_generated_tokens", "Tokens generated.", registry=r)
        self.cached_tokens = Counter(
            "moestream_prompt_tokens_cached", "Prompt tokens taken from the prompt cache.", registry=r
        )
        self.latency = Histogram(
            "moestream_request_latency_seconds",
            "Request arrival to last token.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "moestream_time_to_first_token_seconds",
            "Request arrival to first token.",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        queued = Gauge("moestream_queue_waiting", "Requests waiting for the model.", registry=r)
        queued.set_function(waiting)
        running = Gauge("moestream_slots_busy", "Slots running a request (--parallel).", registry=r)
        running.set_function(busy)
        total = Gauge("moestream_slots", "Slots: requests that run at once (--parallel).", registry=r)
        total.set(slots)
        r.register(_EngineCollector(counters))
        if batch is not None:  # the engine's `Batcher` (engine/batch.py)
            r.register(_BatchCollector(batch))

    def generation(self, gen: Generation) -> None:
        """Count a finished generation (called on the worker thread; prometheus_client is thread-safe)."""
        self.finished.labels(gen.finish_reason).inc()
        self.prompt_tokens.inc(gen.prompt_tokens)
        self.generated_tokens.inc(len(gen.tokens))
        self.cached_tokens.inc(gen.cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The parts of `moestream plan` measured on the model itself: a routing trace of a few prompts, and the
compute cost of a decoded token with every expert it needs already in the cache.

One engine, with a cache that holds every expert (or, where memory is short, the largest of halving
budgets that the memory check accepts), generates on the prompts twice: the first pass reads the experts
(and records the trace), the second finds them all cached, so its decode time per token is compute only:
what a token costs whatever the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moestream.errors import MemoryBudgetError
from moestream.units import format_size

DEFAULT_PROMPTS = (
    "Explain, step by step, why the sky is blue during the day and red at sunset.",
    "Write a short Python function that returns the n-th Fibonacci number, and explain it.",
)


@dataclass(frozen=True)
class ComputeCost:
    """Decode time per token with the needed experts cached, over `tokens` decoded tokens."""

    ms_per_token: float
    tokens: int
    seconds: float
    read_bytes: int  # read during the measured decode: 0 when every needed expert was cached
    read_wait_s: float  # time the measured decode waited for reads (subtracted from ms_per_token)
    cache_bytes: int  # the measuring engine's cache budget
    mode_line: str

    def line(self) -> str:
        read = (
            f"; {self.read_bytes / (1 << 20):.1f} MiB still read, "
            f"{1000 * self.read_wait_s:.0f} ms of waiting subtracted"
            if self.read_bytes
            else ""
        )
        return (
            f"{self.ms_per_token:.1f} ms/token ({self.tokens} decoded tokens with every needed expert "
            f"cached, cache {format_size(self.cache_bytes)}{read})"
        )


def load_for_measuring(path: str, all_experts: int, minimum: int, **options: Any) -> Any:
    """An engine whose cache holds every expert where memory allows, else the largest of halving budgets
    that it does allow (down to `minimum`)."""
    import moestream

    budget = all_experts
    while True:
        try:
            return moestream.load(path, cache=budget, **options)
        except MemoryBudgetError:
            if budget // 2 < minimum:
                raise
            budget //= 2


def measure_compute(
    engine: Any, prompts: list[str], max_tokens: int, trace_path: Path | None = None
) -> ComputeCost:
    """Generate `max_tokens` greedy tokens per prompt twice (the first pass recorded to `trace_path`
    when given); the second pass's decode is the measurement."""
    if trace_path is not None:
        engine.start_trace(trace_path, predict=False)
    try:
        for prompt in prompts:
            engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
    finally:
        if trace_path is not None:
            engine.stop_trace()
    tokens, seconds, read, wait = 0, 0.0, 0, 0.0
    for prompt in prompts:
        decode = engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True).stats.decode
        tokens, seconds = tokens + decode.tokens, seconds + decode.seconds
        read, wait = read + decode.bytes_read, wait + decode.read_wait_s
    if tokens == 0:
        raise ValueError("no token was decoded: max_tokens must be at least 2")
    return ComputeCost(
        1000.0 * (seconds - wait) / tokens,
        tokens,
        seconds,
        read,
        wait,
        engine.options.cache,
        engine.mode_line(),
    )


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """(fn's result, seconds it took)."""
    began = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - began

"""The parts of `moestream plan` measured on the model itself: a routing trace of a few prompts, the
compute cost of a decoded token with every expert it needs already in the cache, and the rate at which
the engine reads experts when nearly every one misses.

One engine, with the auto budget (every expert where memory allows, else the largest cache that fits,
as `--cache auto` sizes it: that budget is a row of plan's table), generates on the prompts twice: the
first pass reads the experts (and records the trace), the second finds them all cached, so its decode
time per token is compute only. Before it, an engine at the smallest budget (top-k slots: every expert
of every layer is read again) decodes a few tokens of the first prompt: the bytes it read over the time
it waited for them is its read rate, and the time it did not wait its compute while streaming.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def load_for_measuring(path: str, **options: Any) -> Any:
    """An engine whose cache is the auto budget (`moestream.engine.auto_budget`): every expert where
    memory allows, else the largest cache that fits; `engine.options.cache` is then that budget."""
    import moestream

    return moestream.load(path, cache="auto", **options)


def auto_choice(engine: Any) -> tuple[int, str]:
    """The auto budget the engine was sized with, and the mode line's account of it."""
    account = next((a for a in engine.loaded.auto if a.tier == "cache"), None)
    return engine.options.cache, account.describe() if account is not None else "auto"


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


@dataclass(frozen=True)
class EngineReadRate:
    """What the engine did at the smallest budget: `nbytes` read over `tokens` decoded tokens in
    `seconds`, `read_wait_s` of them waiting for reads (the rest computing, every layer's experts one by
    one as they land)."""

    nbytes: int
    tokens: int
    seconds: float
    read_wait_s: float
    budget: int

    @property
    def bytes_per_s(self) -> float:
        """Bytes per second of waiting for them (of the whole time where the reads hid in compute)."""
        waited = self.read_wait_s if self.read_wait_s > 0.01 * self.seconds else self.seconds
        return self.nbytes / waited

    @property
    def streaming_ms(self) -> float:
        """Compute per token while streaming: the time not spent waiting for reads."""
        return 1000.0 * (self.seconds - self.read_wait_s) / self.tokens

    def line(self) -> str:
        mib = self.nbytes / (1 << 20) / self.tokens
        ms = 1000 * self.seconds / self.tokens
        return (
            f"{self.bytes_per_s / (1 << 30):.3f} GiB/s, the engine's own: {self.tokens} tokens at the "
            f"smallest budget ({format_size(self.budget)}), {mib:.1f} MiB/token in {ms:.1f} ms/token, of "
            f"which {1000 * self.read_wait_s / self.tokens:.1f} waiting for reads and "
            f"{self.streaming_ms:.1f} computing"
        )


def measure_engine_rate(
    path: str, prompt: str, max_tokens: int, budget: int, **options: Any
) -> EngineReadRate:
    """A fresh engine at `budget` (the smallest) decodes `max_tokens` tokens of `prompt`.

    A fresh process state, not the measuring engine's cache rebuilt smaller: on the 2-core VM of
    BENCHMARKS.md an engine that had just freed a cache of every expert read 20-40% slower for a while."""
    import moestream

    with warnings.catch_warnings():  # that the budget is below a token's working set is the point here
        warnings.filterwarnings("ignore", message="cache budget .* smaller than one token's working set")
        engine = moestream.load(path, cache=budget, **options)
    with engine:
        decode = engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True).stats.decode
    if decode.tokens == 0 or decode.bytes_read == 0:
        raise ValueError("nothing was read at the smallest budget")
    return EngineReadRate(decode.bytes_read, decode.tokens, decode.seconds, decode.read_wait_s, budget)

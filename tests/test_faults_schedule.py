"""Fault injection into the experts' schedule: whatever raises inside a layer forward, every pin and slot
of that forward is given back and the next request gives the tokens a fresh engine gives.

An exception (RuntimeError, KeyboardInterrupt, a failing read, a tensor of the wrong size) is injected
once at every stage of the schedule: routing readback and stale-gate lookahead, observers, the tier's
split, open_layer, queueing reads, each readiness event, prepare, the kernels' byte views, each stage's
compute, the tier's and the cache's release, prefetch, and the reads themselves; on the CPU tier and
both CUDA tiers (skipped without a GPU), with and without prefetch, at the first call and at a later one.
The oracle: the engine's own tokens from before any fault (a fresh engine), and no pin left anywhere.
Bounded: a tiny model, one engine per tier and prefetch setting, a timeout on every case.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import moestream
from moestream.errors import ExpertReadError
from moestream.units import parse_size

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Hello there, how are you?"
N_TOKENS = 6
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
# --device cuda here is the torch CUDA path, even where ggml's CUDA library is built (engine/gpu_path.py)
pytestmark = pytest.mark.usefixtures("torch_cuda_path")
# tier -> load options; the caches hold a few experts only, so every token reads and evicts
TIERS = {
    "cpu": dict(cache="108KiB", io_mode="pagecache"),
    "cuda-slots": dict(device="cuda", cache="60KiB", dtype="bfloat16", io_mode="pagecache"),
    # unified: one tier of host slots, at least top_k (2) x a 36 KiB slot
    "cuda-unified": dict(device="cuda", cache="108KiB", unified=True, dtype="bfloat16", io_mode="pagecache"),
}


class Fault:
    """`obj.name` raises (or returns `mutate` of its result) on its `at`-th call (counting the calls `when`
    accepts), once; then as before."""

    def __init__(
        self,
        obj: Any,
        name: str,
        at: int,
        exc: BaseException,
        mutate: Callable[[Any], Any] | None = None,
        when: Callable[..., bool] = lambda *args, **kwargs: True,
    ) -> None:
        self.obj, self.name, self.fired = obj, name, False
        original, lock, calls = getattr(obj, name), threading.Lock(), [0]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not when(*args, **kwargs):
                return original(*args, **kwargs)
            with lock:  # the reader's threads call `_read` at once
                calls[0] += 1
                now = calls[0] == at
                self.fired |= now
            if now and mutate is None:
                raise exc
            result = original(*args, **kwargs)
            return mutate(result) if now else result

        setattr(obj, name, wrapper)

    def remove(self) -> None:
        delattr(self.obj, self.name)  # the instance attribute shadowed the class's method


def _shorter(raws: list[torch.Tensor]) -> list[torch.Tensor]:
    return [raw[:-1] for raw in raws]  # a tensor one byte short: its view to the weight's shape fails


def _reads_from_compute(requests: list[Any]) -> bool:
    """Reads queued by the compute thread (open_layer, release, prefetch), not an I/O thread's empty call."""
    return bool(requests) and threading.current_thread() is threading.main_thread()


class _Observer:
    """A routing observer that raises (a user's hook with a bug)."""

    def __init__(self, runtime: Any, at: int, exc: BaseException) -> None:
        self.runtime, self.at, self.exc, self.calls, self.fired = runtime, at, exc, 0, False
        runtime.observers.append(self)

    def __call__(self, event: Any) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.fired = True
            raise self.exc

    def remove(self) -> None:
        self.runtime.observers.remove(self)


# point -> how to inject it into an engine (at, exception); the exception a caller then sees
POINTS: dict[str, Callable[[Any, int, BaseException], Any]] = {
    "routing readback": lambda e, at, x: Fault(e.runtime, "_readback", at, x),
    "stale-gate lookahead": lambda e, at, x: Fault(e.runtime, "_lookahead", at, x),
    "observer": lambda e, at, x: _Observer(e.runtime, at, x),
    "tier split": lambda e, at, x: Fault(e.streaming.tier, "split", at, x),
    "open_layer": lambda e, at, x: Fault(e.cache, "open_layer", at, x),
    "queueing reads": lambda e, at, x: Fault(e.reader, "submit", at, x, when=_reads_from_compute),
    "readiness event": lambda e, at, x: Fault(e.cache, "next_event", at, x),
    "prepare": lambda e, at, x: Fault(e.streaming.tier, "prepare", at, x),
    "stage compute": lambda e, at, x: Fault(e.runtime.family, "stage", at, x),
    "tier release": lambda e, at, x: Fault(e.streaming.tier, "release", at, x),
    "cache release": lambda e, at, x: Fault(e.cache, "release", at, x),
    "prefetch": lambda e, at, x: Fault(e.cache, "prefetch", at, x),
    "read fails": lambda e, at, x: Fault(e.reader, "_read", at, OSError(errno.EIO, "Input/output error")),
    "bad tensor": lambda e, at, x: Fault(e.streaming.tier, "raws", at, x, mutate=_shorter),
}
PREFETCH_ONLY = {"stale-gate lookahead", "prefetch"}  # never called without prefetch
KEYBOARD = ["readiness event", "stage compute", "prepare", "queueing reads", "cache release"]

_engines: dict[tuple[str, bool], tuple[moestream.Engine, list[int]]] = {}


@pytest.fixture(scope="module")
def engine_for(tiny_dir):
    """engine_for(tier, prefetch) -> (engine, the tokens it gave fresh), one engine per setting."""

    def make(tier: str, prefetch: bool) -> tuple[moestream.Engine, list[int]]:
        if (tier, prefetch) not in _engines:
            engine = moestream.load(str(tiny_dir("qwen3_moe")), prefetch=prefetch, **TIERS[tier])
            _engines[(tier, prefetch)] = (engine, _generate(engine))
        return _engines[(tier, prefetch)]

    yield make
    for engine, _ in _engines.values():
        engine.close()
    _engines.clear()


def _generate(engine: moestream.Engine, **options: Any) -> list[int]:
    return engine.generate(PROMPT, max_tokens=N_TOKENS, ignore_eos=True, **options).tokens


def assert_nothing_held(engine: moestream.Engine) -> None:
    """No pin in the host cache (once the reads a failed forward left running have landed), none in the
    GPU tier."""
    cache = engine.cache
    deadline = time.monotonic() + 10
    while cache._prefetching and time.monotonic() < deadline:
        time.sleep(0.002)
    with cache.lock:
        pinned = {key: s.pins for key, s in cache._states.items() if s.pins}
        reading = cache._prefetching
    assert not pinned and not reading, (pinned, reading)
    slots = getattr(engine.streaming.tier, "slots", {})
    assert not {key: s.pins for key, s in slots.items() if s.pins}


def _run_case(engine_for, tier: str, prefetch: bool, point: str, at: int, exc: BaseException) -> None:
    engine, fresh = engine_for(tier, prefetch)
    fault = POINTS[point](engine, at, exc)
    expected = ExpertReadError if point == "read fails" else type(exc)
    try:
        with pytest.raises(Exception if point == "bad tensor" else expected):
            _generate(engine)
    finally:
        fault.remove()
    assert fault.fired
    assert_nothing_held(engine)
    assert _generate(engine) == fresh  # the next request works, with a fresh engine's tokens
    assert_nothing_held(engine)


def _cases(tiers: list[str]) -> list[Any]:
    cases = []
    for tier in tiers:
        marks = [CUDA, pytest.mark.cuda] if tier != "cpu" else []
        for prefetch in (False, True):
            for point in POINTS:
                if point in PREFETCH_ONLY and not prefetch:
                    continue
                for at in (1, 5):
                    cases.append(pytest.param(tier, prefetch, point, at, marks=marks))
    return cases


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tier, prefetch, point, at", _cases(list(TIERS)))
def test_an_exception_anywhere_in_the_schedule_leaves_nothing_held(engine_for, tier, prefetch, point, at):
    """Before: an exception from a readiness event, a stage or a release left the layer's experts pinned;
    with a small cache the next request stopped at 'waits for an expert slot that nothing will release'."""
    _run_case(engine_for, tier, prefetch, point, at, RuntimeError(f"injected at {point}"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "tier, prefetch, point, at",
    [c for c in _cases(list(TIERS)) if c.values[2] in KEYBOARD and c.values[3] == 5],
)
def test_keyboard_interrupt_in_the_schedule_leaves_nothing_held(engine_for, tier, prefetch, point, at):
    _run_case(engine_for, tier, prefetch, point, at, KeyboardInterrupt())


@pytest.mark.timeout(60)
def test_an_expert_failure_in_a_continued_prompt_keeps_the_prompt_cache(engine_for):
    """Before: a RuntimeError from the experts while a reused KV cache was continued was taken for
    transformers failing to continue it: the prompt cache was switched off for good, with a warning."""
    engine, _ = engine_for("cpu", False)
    first = engine.generate(PROMPT, max_tokens=3, cache_prompt=True, ignore_eos=True)
    follow = [*first.tokens, 17, 23, 41]  # the previous prompt and answer, then more
    ids = engine.encode(PROMPT) + follow
    fault = Fault(engine.runtime.family, "stage", 1, RuntimeError("injected"))
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate(ids, max_tokens=2, cache_prompt=True)
    finally:
        fault.remove()
    assert engine.prompt_cache.disabled is None
    assert_nothing_held(engine)
    engine.generate(PROMPT, max_tokens=3, cache_prompt=True, ignore_eos=True)
    again = engine.generate(ids, max_tokens=2, cache_prompt=True)
    assert again.cached_tokens > 0  # still reused


SIGINT_CHILD = """
    import signal, sys, time
    import moestream
    from moestream.io.reader import Reader

    # as in an interactive Python: a child of a background job inherits SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler (the run that read this test's 200 tokens through a Ctrl-C)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    class SlowReader(Reader):  # every piece takes 20 ms: a request runs for seconds
        def _read(self, request, start):
            time.sleep(0.02)
            return super()._read(request, start)

    ckpt = sys.argv[1]
    options = dict(cache="108KiB", io_mode="pagecache")
    fresh = moestream.load(ckpt, **options).generate("Hello there", max_tokens=8, ignore_eos=True).tokens
    engine = moestream.load(ckpt, make_reader=SlowReader, **options)
    try:
        for gen in engine.stream("Hello there", max_tokens=200, ignore_eos=True):
            print("token", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    again = engine.generate("Hello there", max_tokens=8, ignore_eos=True).tokens
    print("same" if again == fresh else f"different {again} {fresh}", flush=True)
"""


@pytest.mark.timeout(120)
def test_ctrl_c_in_the_python_api_then_the_next_request_works(tiny_dir, tmp_path):
    """A real SIGINT while a layer waits for its reads (KeyboardInterrupt out of a blocked queue get)."""
    ckpt = tiny_dir("qwen3_moe")
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SIGINT_CHILD), str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        for _ in range(3):
            assert child.stdout.readline() == "token\n"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=90)
    finally:
        child.kill()
    assert child.returncode == 0, err[-2000:]
    lines = [line for line in out.splitlines() if line != "token"]
    assert lines == ["interrupted", "same"], (lines, err[-2000:])


@pytest.mark.timeout(60)
def test_a_failed_restream_keeps_the_previous_setup(tiny_dir):
    """Before: restream closed the running setup first; one that then failed to build (a budget below one
    layer, a reader that cannot open the files) left an engine whose every request failed."""
    from moestream.errors import CacheBudgetError, MoestreamError
    from moestream.io.reader import Reader

    with moestream.load(str(tiny_dir("qwen3_moe")), **TIERS["cpu"]) as engine:
        fresh = _generate(engine)
        with pytest.raises(CacheBudgetError):
            engine.restream(cache="1KiB")
        assert engine.unavailable is None and _generate(engine) == fresh
        calls = []

        def reader_failing_once(mode: str, threads: int) -> Reader:
            calls.append(mode)
            if len(calls) == 1:
                raise MoestreamError("the new reader failed")
            return Reader(mode, threads)

        engine.loaded.make_reader = reader_failing_once
        with pytest.raises(MoestreamError, match="the new reader failed"):
            engine.restream(io_mode="mmap")
        assert calls == ["mmap", "pagecache"]  # the previous setup was rebuilt
        assert engine.unavailable is None and engine.options.io_mode == "pagecache"
        assert _generate(engine) == fresh
        assert_nothing_held(engine)


@pytest.mark.timeout(60)
def test_a_restream_that_fails_after_its_build_closes_what_it_built(tiny_dir, monkeypatch):
    """A new setup built, then a failed read of every expert at load: that setup's reader and cache are
    closed (not left to the garbage collector, its I/O threads running), and the previous one is rebuilt."""
    import moestream.engine.loaded as loaded

    with moestream.load(str(tiny_dir("qwen3_moe")), **TIERS["cpu"]) as engine:
        fresh = _generate(engine)
        built = []
        build = loaded.LoadedModel._build_streaming

        def recording(self):
            built.append(build(self))
            return built[-1]

        def failing(cache):
            raise ExpertReadError("injected: the read at load failed")

        monkeypatch.setattr(loaded.LoadedModel, "_build_streaming", recording)
        monkeypatch.setattr(loaded, "read_all", failing)
        with pytest.raises(ExpertReadError, match="injected"):
            engine.restream(cache="64MiB")  # holds every expert: read at load
        assert len(built) == 2 and built[0].closed and not built[1].closed
        assert engine.streaming is built[1] and engine.unavailable is None
        assert engine.options.cache == parse_size(TIERS["cpu"]["cache"])
        monkeypatch.undo()
        assert _generate(engine) == fresh
        assert_nothing_held(engine)

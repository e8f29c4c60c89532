"""The engine's expert streaming (reader, cache, tier, runtime bound to every StreamingExperts module):
built at load, every expert read at load where the cache holds them all, rebuilt by `Engine.restream`
with other sizes or I/O settings, keeping the loaded model."""

from __future__ import annotations

import time
from typing import Any

from moestream.cache.read_at_load import read_all
from moestream.engine.memory_plan import plan_restream
from moestream.engine.options import EngineOptions
from moestream.engine.unused import refuse_unused
from moestream.errors import MoestreamError
from moestream.model.arch import text_config
from moestream.model.loader import router_modules
from moestream.runtime.streaming import ExpertStreaming
from moestream.units import format_size


def build_streaming(engine: Any) -> ExpertStreaming:
    """A fresh reader, cache, tier and runtime, bound to every StreamingExperts module."""
    streaming = ExpertStreaming(
        engine.emap,
        engine.family,
        engine.options.stream_config(),
        top_k=engine.top_k,
        device=engine.device,
        make_reader=engine._make_reader,
        files=engine.files,
    )
    if engine._spec is not None:
        streaming.runtime.use_graph_kernels()
    if engine.options.prefetch != "off":
        streaming.enable_lookahead(router_modules(engine.model))
    streaming.bind(engine._modules)
    return streaming


def rebuild_streaming(engine: Any, **changes: Any) -> None:
    """Rebuild reader, cache and runtime with other `cache`, `io_mode`, `io_threads`, `piece`,
    `lock_memory`, `policy`, `prefetch`, `preload` or the CUDA tiers, keeping the loaded model:
    side-by-side comparisons without reloading."""
    unknown = set(changes) - {
        "cache",
        "io_mode",
        "io_threads",
        "piece",
        "lock_memory",
        "gpu_cache",
        "host_cache",
        "prefetch",
        "policy",
        "preload",
    }
    if unknown:
        raise ValueError(f"restream cannot change {', '.join(sorted(unknown))}")
    tiers = {k: v for k, v in changes.items() if k in ("gpu_cache", "host_cache")}
    refuse_unused(engine.options.device, {**tiers, "unified": engine.options.unified})  # as at load
    try:
        options = EngineOptions(**{**vars(engine.options), **changes})
    except ValueError as exc:
        raise MoestreamError(str(exc)) from None
    if options.auto:
        raise MoestreamError("restream takes sizes: an auto budget is sized when the model loads")
    engine.check_usable()
    options = plan_restream(engine, options)  # against the room the current cache gives back
    recorder, previous = engine.recorder, engine.options
    if recorder is not None:
        recorder.detach(engine.runtime)
    engine.runner.before_restream()  # what reads the slot buffer closed next
    engine.trunk_line = engine._trunk_base
    engine.streaming.close()
    try:
        engine.options = options
        engine.streaming = build_streaming(engine)
        engine.runtime.replay = engine.replay
        engine.trunk_line = engine._trunk_base + read_resident(engine)
        engine.auto = []  # the sizes given now are the ones in use
    except BaseException as exc:  # the previous setup, so that a failed restream leaves a usable engine
        engine.options = previous
        try:
            engine.streaming = build_streaming(engine)
            engine.runtime.replay = engine.replay
        except BaseException as again:
            engine.broken = f"a restream failed ({exc}) and the previous setup could not be rebuilt ({again})"
            raise
        raise
    finally:
        if recorder is not None and engine.broken is None:
            recorder.attach(engine)


def read_resident(engine: Any) -> str:
    """Every expert read at load where the cache holds them all (unless `preload` is off): into the
    GPU tier, the step then one graph; or into the host cache that the kernels read in place (CPU,
    unified memory), so that no request waits for a first read."""
    if not engine.options.preload:
        return ""
    words = engine.runner.resident_part(engine.top_k, int(text_config(engine.config).hidden_size))
    cache = engine.streaming.cache
    if words or not engine.runtime.tier.in_place or cache is None or not cache.holds_all():
        return words
    start = time.perf_counter()
    read = format_size(read_all(cache))
    return f"; every expert cached, read at load ({read} in {time.perf_counter() - start:.1f} s)"

"""What a run will hold in host memory, checked before the trunk is read or the cache taken (from the
model's frozen description, `ModelDescription`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moestream.cache.expert_cache import ExpertCache
from moestream.cache.size_classes import budget_requirements
from moestream.engine.kvcache import kv_cache_bytes
from moestream.engine.memory import (
    WORKING_BYTES,
    MemoryNeed,
    check_memory,
    lock_allowed,
    memlock_room,
    memory_rooms,
)
from moestream.engine.model_description import ModelDescription
from moestream.engine.options import AUTO, EngineOptions
from moestream.model.loader import is_router_tensor, trunk_tensors
from moestream.runtime.streaming import host_cache_bytes
from moestream.store.tensors import LazyTensor, QuantizedTensor

CACHE = "the expert cache"


def trunk_bytes(tensors: dict[str, Any], dtype: torch.dtype | None, keep_blocks: bool = True) -> int:
    """Bytes the trunk will take once read: stored bytes, or `dtype`'s for floating tensors converted
    (and for GGUF block tensors too when they are dequantized, `keep_blocks` False)."""
    total = 0
    for tensor in tensors.values():
        blocks = isinstance(tensor, QuantizedTensor)
        if dtype is not None and tensor.is_floating_point() and not (blocks and keep_blocks):
            total += tensor.shape.numel() * dtype.itemsize
        elif isinstance(tensor, LazyTensor):
            total += tensor.ref.nbytes
        else:  # computed from the file on first use (a GGUF tensor undone from llama.cpp's layout)
            total += tensor.shape.numel() * tensor.dtype.itemsize
    return total


def _element_bytes(tensors: dict[str, Any], dtype: torch.dtype | None) -> int:
    """Bytes of one KV-cache element: the model's dtype (with "auto", the trunk's stored floating type)."""
    if dtype is not None:
        return dtype.itemsize
    stored = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    return stored.itemsize


def memory_need(
    model: ModelDescription, options: EngineOptions, tensors: dict[str, Any] | None = None
) -> MemoryNeed:
    """The run's expert cache (or pinned staging slots), trunk, KV cache and working memory
    (`tensors`: the trunk as `trunk_tensors` gives it for these options, looked up when None). On ggml's
    CUDA backend (`options.ggml_device`) the trunk's host copy is given back at load but the routers'
    (`engine/trunk_release.py`, before the cache is taken): only those are counted (the load's own need,
    the whole trunk, is `load_need`'s)."""
    tensors, dtype, keep = _trunk(model, options, tensors)
    config = options.stream_config()
    host = host_cache_bytes(model.emap, config, model.top_k, model.device)
    kept = tensors
    if options.ggml_device is not None:  # given back at load but the routers' (`engine/trunk_release.py`)
        kept = {k: t for k, t in tensors.items() if is_router_tensor(k)}
    trunk = trunk_bytes(kept, dtype, keep_blocks=keep)
    on_host = model.device.type != "cuda"  # on a GPU, the KV cache is the GPU's
    # so it is on ggml's CUDA backend (--device cuda resolved to it: torch's side of the run is the CPU,
    # and the runner's host tensors only name the device's copies, never written)
    kv_here = on_host and options.ggml_device is None
    kv = kv_cache_bytes(model.config, model.ctx_size, _element_bytes(tensors, dtype)) if kv_here else 0
    kv *= model.parallel  # a KV cache per slot
    parts = [
        (CACHE if on_host else "the pinned staging slots", host),
        ("the trunk", trunk),
        (f"the KV cache at {model.ctx_size} tokens{_slots(model.parallel)}", kv),
        ("working memory", WORKING_BYTES),
    ]
    return MemoryNeed(parts, locked=(host + (trunk if on_host else 0)) if options.lock_memory else 0)


def _trunk(
    model: ModelDescription, options: EngineOptions, tensors: dict[str, Any] | None
) -> tuple[dict[str, Any], torch.dtype | None, bool]:
    """The trunk's tensors for these options (`tensors`, looked up when None), the dtype it is computed
    in (None: as stored) and whether GGUF blocks are kept as they are."""
    name = options.trunk_dtype or options.dtype
    dtype = None if name == "auto" else getattr(torch, name)
    keep = options.trunk_dtype is None
    if tensors is None:
        tensors = trunk_tensors(model.source, model.config, model.arch, model.emap, keep)
    return tensors, dtype, keep


def load_need(
    model: ModelDescription, options: EngineOptions, tensors: dict[str, Any] | None = None
) -> MemoryNeed | None:
    """On ggml's CUDA backend (`options.ggml_device`), what the load holds before the trunk's host copy is
    given back (`engine/trunk_release.py`; the expert cache is taken after): the whole trunk and working
    memory; None elsewhere (`memory_need` counts the trunk). `tensors`: as for `memory_need`."""
    if options.ggml_device is None:
        return None
    tensors, dtype, keep = _trunk(model, options, tensors)
    trunk = trunk_bytes(tensors, dtype, keep_blocks=keep)
    return MemoryNeed(
        [("the trunk, read before it is copied to the GPU", trunk), ("working memory", WORKING_BYTES)]
    )


def plan_memory(
    model: ModelDescription, options: EngineOptions, tensors: dict[str, Any] | None = None
) -> EngineOptions:
    """Refuse a run that cannot fit (MemoryBudgetError); the options to run with (unlocked where
    RLIMIT_MEMLOCK forbids locking). `tensors`: as for `memory_need`. An auto budget is checked at its
    smallest here, before anything is read, and sized once the trunk is in (`auto_budget.size_auto`).
    On ggml's CUDA backend the load's own need (`load_need`) is checked too."""
    tensors = _trunk(model, options, tensors)[0]  # looked up once for the checks below
    loading = load_need(model, options, tensors)
    if loading is not None:
        check_memory(loading, memory_rooms())
    part = CACHE if model.device.type != "cuda" else "the pinned staging slots"
    if options.auto:
        minimum = budget_requirements(model.emap, model.top_k)[0]
        smallest = {
            name: minimum if value == AUTO else value
            for name, value in (("cache", options.cache), ("gpu_cache", options.gpu_cache))
        }
        host = 0 if options.host_cache == AUTO else options.host_cache
        smallest = dataclasses.replace(options, **smallest, host_cache=host)
        check_memory(memory_need(model, smallest, tensors), memory_rooms(), part, minimum=minimum)
        return options  # locking is checked for the size chosen
    need = memory_need(model, options, tensors)
    check_memory(need, memory_rooms(), part)
    if options.lock_memory and not lock_allowed(need, memlock_room()):
        return dataclasses.replace(options, lock_memory=False)
    return options


def plan_restream(model: ModelDescription, options: EngineOptions, cache: ExpertCache) -> EngineOptions:
    """As `plan_memory` for a new streaming setup: its cache against the room, plus what the current
    `cache` gives back when it is closed first (the trunk and KV cache are held already)."""
    current = cache.allocated_bytes
    new = host_cache_bytes(model.emap, options.stream_config(), model.top_k, model.device)
    need = MemoryNeed([(CACHE, new)], locked=new if options.lock_memory else 0)
    rooms = [dataclasses.replace(r, nbytes=r.nbytes + current) for r in memory_rooms()]
    check_memory(need, rooms)
    lock = memlock_room()
    if lock is not None and cache.locked:
        lock = dataclasses.replace(lock, nbytes=lock.nbytes + current)
    if options.lock_memory and not lock_allowed(need, lock):
        return dataclasses.replace(options, lock_memory=False)
    return options


def _slots(parallel: int) -> str:
    """The KV cache's words for its slots (`--parallel`)."""
    return f" in each of {parallel} slots" if parallel > 1 else ""

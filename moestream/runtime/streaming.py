"""`ExpertStreaming`: everything that streams routed experts, owned in one place below the engine.

It owns the reader (checkpoint file descriptors, I/O threads), the expert cache (locked slots), the
device tier and the runtime that computes experts over them, and it describes and counts them (the
mode line's streaming part, cumulative counters). The engine builds one, binds the model's
`StreamingExperts` modules to its runtime, and closes it; `restream` is a new one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moestream.cache.expert_cache import ExpertCache
from moestream.cache.policy import EvictionPolicy, LFUPolicy, LRUPolicy
from moestream.cache.predictive import PredictivePolicy
from moestream.cache.size_classes import budget_requirements, planned_bytes
from moestream.errors import CheckpointChangedError
from moestream.io.reader import CheckpointFiles, Reader
from moestream.runtime.experts import ExpertRuntime
from moestream.runtime.families import ExpertFamily
from moestream.runtime.prefetch import PrefetchGate
from moestream.runtime.tiers import DeviceTier, HostTier
from moestream.store.experts import ExpertMap
from moestream.units import format_size

POLICY_CLASSES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "predictive": PredictivePolicy,
}
ReaderFactory = Callable[[str, int], Reader]  # (io_mode, io_threads) -> Reader
Step = Callable[..., tuple[Any, Any]]  # (ids, KV cache, greedy=) -> (logits, KV cache)
_PREFETCH_LINE = {
    "off": "",
    "on": ", next-layer prefetch (confident guesses)",
    "auto": ", next-layer prefetch auto (confident guesses, while the disk idles)",
}


@dataclass(frozen=True)
class StreamConfig:
    """How experts are streamed (validated by `EngineOptions`; sizes in bytes)."""

    cache: int
    io_mode: str = "direct"
    io_threads: int = 4
    piece: int = 128 * 1024
    lock_memory: bool = True
    policy: str = "lru"
    prefetch: str = "off"  # "off", "on" or "auto" (runtime/prefetch.py)
    gpu_cache: int | None = None  # CUDA: GPU expert slots (None: `cache`)
    host_cache: int = 0  # CUDA: pinned host slots between disk and GPU (0: staging only)
    unified: bool | None = None  # CUDA: one pinned, device-mapped tier (None: on integrated GPUs only)


@dataclass
class StreamCounters:
    """A snapshot of the cumulative streaming counters. A hit is an expert not read from disk."""

    bytes_read: int
    hits: int
    misses: int
    read_wait_s: float
    prefetches: int = 0
    prefetch_used: int = 0


class ExpertStreaming:
    """Reader + cache + tier + runtime for one `ExpertMap`, on one device."""

    def __init__(
        self,
        emap: ExpertMap,
        family: ExpertFamily,
        config: StreamConfig,
        *,
        top_k: int,
        device: torch.device,
        make_reader: ReaderFactory = Reader,
        graph_kernels: bool = False,
        files: CheckpointFiles | None = None,
    ) -> None:
        """`graph_kernels`: the ggml graphs' runner computes the model (`ExpertRuntime`'s mode: every
        expert product by the graphs' kernel, so that an expert computed here gives their bits).
        `files`: the checkpoint files as the model loaded them, held open (a restream reads those)."""
        self.emap, self.config, self.device = emap, config, device
        self.reader = make_reader(config.io_mode, config.io_threads)
        if files is not None:
            self.reader.use_files(files)
        self.tier: DeviceTier | None = None
        self.cache: ExpertCache | None = None
        self.closed = False
        # a checkpoint file was seen changed: the slots may hold bytes read from it while it changed
        self.suspect = False
        try:
            for name in emap.files:
                self.reader.open(name)  # decides O_DIRECT (or its fallback) before the mode line is printed
            self.cache, self.tier = self._tier(top_k, family)
            self.runtime = ExpertRuntime(self.cache, self.tier, family, graph_kernels)
        except BaseException:
            self.close()
            raise
        if config.prefetch != "off":
            self.runtime.prefetch = PrefetchGate(
                config.prefetch,
                self.reader,
                len(emap.layers),
                queue_full_bytes=top_k * max(emap.unit_bytes(*key) for key in emap.units),
            )

    def _tier(self, top_k: int, family: ExpertFamily) -> tuple[ExpertCache, DeviceTier]:
        c, policy = self.config, policy_factory(self.config.policy, self.emap)
        if self.device.type != "cuda":
            cache = self._cache(c.cache, top_k, policy)
            return cache, HostTier(cache)
        from moestream.runtime.cuda import GpuSlotTier, UnifiedTier

        if uses_unified_memory(c.unified, self.device):
            cache = self._cache(c.cache, top_k, policy)
            return cache, UnifiedTier(cache, self.device)
        _, working_set = budget_requirements(self.emap, top_k)
        cache = self._cache(staging_budget(self.emap, c, top_k), top_k, policy, warn_working_set=False)
        gpu = GpuSlotTier(
            cache,
            c.cache if c.gpu_cache is None else c.gpu_cache,
            self.device,
            top_k,
            family.fusions,
            policy(),
        )
        if gpu.capacity * gpu.slot_bytes + cache.allocated_bytes < working_set:
            warnings.warn(
                f"GPU + host cache ({format_size(gpu.capacity * gpu.slot_bytes + cache.allocated_bytes)})"
                f" is smaller than one token's working set ({format_size(working_set)})",
                RuntimeWarning,
                stacklevel=4,
            )
        return cache, gpu

    def _cache(
        self, budget: int, top_k: int, policy: Callable[[], EvictionPolicy], warn_working_set: bool = True
    ) -> ExpertCache:
        c = self.config
        # kept at once: a tier that fails after it is built still frees (and unlocks) it in close
        self.cache = ExpertCache(
            self.emap,
            budget,
            self.reader,
            top_k=top_k,
            piece_bytes=c.piece,
            lock_memory=c.lock_memory,
            policy_factory=policy,
            warn_working_set=warn_working_set,
        )
        return self.cache

    def enable_lookahead(self, routers: dict[int, torch.nn.Module]) -> None:
        """Give the runtime the routers of the streamed layers (stale-gate prefetch and trace predictions)."""
        self.runtime.set_lookahead(
            {layer: router for layer, router in routers.items() if layer in set(self.emap.layers)}
        )

    def bind(self, modules: list[tuple[int, Any]]) -> None:
        """Point every `StreamingExperts` module (layer, module) at this runtime."""
        for layer, module in modules:
            module.bind(layer, self.runtime)

    def check_files(self) -> None:
        """Refuse to go on when the bytes of a checkpoint file changed since it was opened
        (`Reader.check_files`; a file replaced by rename or removed is only said, once); the streaming
        is then `suspect` for good (its slots are to be read again, see `Engine.stream`).

        Raises:
            CheckpointChangedError: naming the first changed file and how it changed.
        """
        try:
            self.reader.check_files()
        except CheckpointChangedError:
            self.suspect = True
            raise

    def checked(self, step: Step) -> Step:
        """`step` (one forward), then `check_files`: a forward that read expert bytes while a shard was
        being rewritten raises before its logits can be sampled, so no token computed from changed bytes
        is ever presented. A write moves the file's mtime before it changes any byte a read can see, so
        a check after the forward covers every read the forward waited for (fstat + stat per shard:
        BENCHMARKS.md, "A checkpoint changed during a request"). Keywords go to `step` (`greedy`)."""

        def run(ids: list[int], cache: Any, **kwargs: Any) -> tuple[Any, Any]:
            return self._ended(lambda: step(ids, cache, **kwargs))

        launch = getattr(step, "launch", None)
        if launch is not None:  # a step started (`ModelRunner.launch`): checked once it has ended
            run.launch = lambda ids, cache, **kwargs: self._checked_launch(launch, ids, cache, **kwargs)
        return run

    def _ended(self, call: Callable[[], Any], check: bool = True) -> Any:
        """`call()` (a forward, or the part of one that waits for it), then `check_files` unless `check`
        is False (the forward only started)."""
        try:
            out = call()
        except CheckpointChangedError:  # a read that failed because the file changed under it
            self.suspect = True
            raise
        if check:
            self.check_files()
        return out

    def _checked_launch(self, launch: Callable, ids: list[int], cache: Any, **kwargs: Any) -> Any:
        """`checked` for a started step: `launch`'s waiter, which checks the files once the step ended."""
        done = self._ended(lambda: launch(ids, cache, **kwargs), check=False)
        return None if done is None else lambda: self._ended(done)

    def describe(self) -> str:
        """The streaming part of the mode line: io mode, threads, pieces, prefetch, memory, policy."""
        c = self.config
        io = self.reader.io_mode + (
            f" (fallback: {self.reader.fallback_reason})" if self.reader.fallback_reason else ""
        )
        return (
            f"io {io}, {c.io_threads} io threads, {c.piece // 1024} KiB pieces"
            f"{_PREFETCH_LINE[c.prefetch]} | {self.tier.describe()}"
            f"{'' if c.policy == 'lru' else ', ' + c.policy.upper() + ' eviction'}"
        )

    def counters(self) -> StreamCounters:
        s = self.cache.stats
        return StreamCounters(
            self.reader.bytes_read,
            s.hits + self.tier.stats.gpu_hits,
            s.misses,
            s.read_wait_s,
            s.prefetches,
            s.prefetch_used,
        )

    def close(self) -> None:
        """Release the tier (GPU memory, page-locking), stop the I/O threads, close the files, then unlock
        and free the host cache (at once, not when the last reference goes)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.tier is not None:
                self.tier.close()
        finally:
            self.reader.close()
            if self.cache is not None:
                self.cache.close()


def policy_factory(name: str, emap: ExpertMap) -> Callable[[], EvictionPolicy]:
    """A new policy per resident set: the predictive one learns over this map's layers and experts."""
    if name == "predictive":
        layers, n_experts = sorted(emap.layers), emap.num_experts
        return lambda: PredictivePolicy(layers, n_experts)
    return POLICY_CLASSES[name]


def uses_unified_memory(unified: bool | None, device: torch.device) -> bool:
    """--unified, or by default on integrated GPUs (Jetson), whose memory is the host's."""
    if unified is not None:
        return unified
    return bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))


def staging_budget(emap: ExpertMap, config: StreamConfig, top_k: int) -> int:
    """Budget of the pinned host tier between disk and GPU slots; host_cache 0 means staging only: one
    layer's worst case, or two with prefetch (the next layer's reads need slots while this layer's are
    still pinned)."""
    minimum, _ = budget_requirements(emap, top_k)
    return max(config.host_cache, minimum * (2 if config.prefetch != "off" else 1))


def host_cache_bytes(emap: ExpertMap, config: StreamConfig, top_k: int, device: torch.device) -> int:
    """Host memory the streaming will allocate for `config`: the expert cache (CPU, unified memory) or
    the pinned staging slots (GPU slots), before anything is allocated."""
    if device.type == "cuda" and not uses_unified_memory(config.unified, device):
        return planned_bytes(emap, staging_budget(emap, config, top_k), top_k)
    return planned_bytes(emap, config.cache, top_k)

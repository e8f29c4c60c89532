"""What the expert cache keeps per expert and per layer forward: an expert's `SlotState`, a forward's
`LayerJob` (its handle on the cache), the `CacheStats` counters, and what one admission `Admitted`. The
fields are the cache's to change, under its lock (`expert_cache.py`)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Protocol

from moestream.cache.size_classes import Key, SizeClass
from moestream.cache.slots import PartRead
from moestream.io.memory import AlignedBuffer
from moestream.io.reader import Request


@dataclass
class CacheStats:
    """Counters of everything the cache did; the engine snapshots them per phase."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    read_wait_s: float = 0.0
    miss_bytes: int = 0  # tensor bytes of the missed experts (the reader's count adds alignment)
    prefetches: int = 0  # experts read ahead of their layer
    prefetch_bytes: int = 0
    prefetch_used: int = 0  # prefetched experts that their layer then asked for


@dataclass
class SlotState:
    """An expert occupying a slot: which kinds are still being read, and who waits for them."""

    key: Key
    cls: SizeClass
    slot: int
    plan: dict[str, list[PartRead]]
    remaining: dict[str, int]  # reads (parts) still in flight, per kind
    errors: dict[str, BaseException | None]
    pins: int = 0
    listeners: list[LayerJob] = field(default_factory=list)
    # holds a pin of its own until its reads are done: a prefetch, or the reads of a forward that failed
    prefetching: bool = False
    prefetched: bool = False  # read ahead and not asked for yet
    addresses: dict[str, int] | None = None  # kind -> where its bytes are, once read (`pin_all_hits`)
    # parts whose bytes have not landed yet, per kind: counted down as each lands, before `remaining`,
    # so that of a repacked kind exactly one part (the last to land) rewrites it
    landing: dict[str, int] = field(default_factory=dict)

    @property
    def base(self) -> int:
        return self.slot * self.cls.slot_bytes

    @property
    def failed(self) -> bool:
        return any(e is not None for e in self.errors.values())


@dataclass
class Admitted:
    """What admitting misses under the lock produced: reads to queue and the states they evicted."""

    reads: list[Request] = field(default_factory=list)
    evicted: list[SlotState] = field(default_factory=list)


class JobOwner(Protocol):
    """What a `LayerJob` asks of its cache (`ExpertCache`)."""

    def next_event(self, job: LayerJob) -> tuple[int, str, BaseException | None]: ...

    def drop_pending(self, job: LayerJob) -> list[int]: ...

    def tensor_parts(self, key: Key, kind: str) -> list[tuple[AlignedBuffer, int, PartRead]]: ...

    def release(self, job: LayerJob, expert: int) -> None: ...


class LayerJob:
    """One layer forward's handle on the cache: readiness events in, releases out. Its fields are the
    cache's to change (under the cache lock); compute calls the methods."""

    def __init__(self, cache: JobOwner, layer: int, experts: list[int], seq: int) -> None:
        self.cache, self.layer, self.seq = cache, layer, seq
        self.keys = {(layer, e) for e in experts}  # never evicted to make room for each other
        self.events: queue.SimpleQueue[tuple[int, str, BaseException | None]] = queue.SimpleQueue()
        self.hits: list[int] = []
        self.misses: list[int] = []
        self.pending: list[int] = []  # misses still waiting for a slot
        self.admitted = 0  # misses given a slot so far
        self.held: set[int] = set()  # experts this job pinned and has not released
        self.wait_s = 0.0

    def next_event(self) -> tuple[int, str, BaseException | None]:
        """The next (expert, kind, error-or-None) whose bytes are in place; blocks while reads run."""
        return self.cache.next_event(self)

    def drop_pending(self) -> list[int]:
        return self.cache.drop_pending(self)

    def tensor_parts(self, expert: int, kind: str) -> list[tuple[AlignedBuffer, int, PartRead]]:
        return self.cache.tensor_parts((self.layer, expert), kind)

    def release(self, expert: int) -> None:
        self.cache.release(self, expert)

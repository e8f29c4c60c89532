"""The expert cache: a byte budget of locked slots, filled by the reader, evicted by the policy.

One owner: this object owns slot memory and decides (through `ResidentSet`) which expert sits where.
Compute asks for one layer at a time with `open_layer`, which returns a `LayerJob` that delivers one
readiness event per (expert, kind): at once for cached experts, when the last piece lands for misses.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from moestream.cache.policy import EvictionPolicy, LRUPolicy, ResidentSet
from moestream.cache.slots import PartRead, plan_parts, slot_bytes
from moestream.errors import CacheBudgetError
from moestream.io.memory import AlignedBuffer
from moestream.io.reader import Reader, Request
from moestream.store.experts import ExpertMap
from moestream.units import format_size

Key = tuple[int, int]  # (layer, expert)


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
class SizeClass:
    """All slots of one size, carved from one aligned allocation."""

    slot_bytes: int
    capacity: int
    buffer: AlignedBuffer
    residents: ResidentSet


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
    listeners: list["LayerJob"] = field(default_factory=list)
    prefetching: bool = False  # holds a pin of its own until its reads are done
    prefetched: bool = False  # read ahead and not asked for yet

    @property
    def base(self) -> int:
        return self.slot * self.cls.slot_bytes

    @property
    def failed(self) -> bool:
        return any(e is not None for e in self.errors.values())


def budget_requirements(emap: ExpertMap, top_k: int) -> tuple[int, int]:
    """(one layer's worst case, one token's working set over all layers) in slot bytes."""
    per_layer = {}
    for (layer, _), parts in emap.units.items():
        per_layer[layer] = max(per_layer.get(layer, 0), slot_bytes(parts))
    return top_k * max(per_layer.values()), top_k * sum(per_layer.values())


class ExpertCache:
    """Bounded, locked expert cache over an `ExpertMap`, filled through a `Reader`."""

    def __init__(
        self,
        emap: ExpertMap,
        budget_bytes: int,
        reader: Reader,
        *,
        top_k: int,
        piece_bytes: int = 128 * 1024,
        lock_memory: bool = True,
        policy_factory: Callable[[], EvictionPolicy] = LRUPolicy,
        warn_working_set: bool = True,
    ) -> None:
        if piece_bytes < 4096 or piece_bytes % 4096:
            raise ValueError(f"piece size must be a positive multiple of 4 KiB, got {piece_bytes}")
        self.emap, self.reader, self.piece_bytes = emap, reader, piece_bytes
        self.lock = threading.Lock()
        self.stats = CacheStats()
        self._job_seq = itertools.count()
        self.last_job_seq = -1
        self._states: dict[Key, SlotState] = {}
        self._plans: dict[Key, dict[str, list[PartRead]]] = {}  # slot layout of each expert, computed once
        self._prefetching = 0  # prefetched experts whose reads are still in flight (each holds a pin)
        self._open_job: LayerJob | None = (
            None  # the last opened layer job (its experts are never its victims)
        )
        # called with the state of an evicted expert before its slot is refilled (CUDA: pending copies)
        self.on_evict: Callable[[SlotState], None] | None = None
        self._check_budget(budget_bytes, top_k, warn_working_set)
        self.classes, self._class_of = self._carve(budget_bytes, top_k, policy_factory)
        self.locked = all(c.buffer.lock() for c in self.classes) if lock_memory else False
        self.budget_bytes = budget_bytes

    def _check_budget(self, budget: int, top_k: int, warn_working_set: bool) -> None:
        minimum, working_set = budget_requirements(self.emap, top_k)
        if budget < minimum:
            raise CacheBudgetError(
                f"cache budget {format_size(budget)} is below one layer's worst case "
                f"(top_k {top_k} x largest expert slot = {format_size(minimum)}, {minimum} bytes); "
                f"use a cache of at least {format_size(minimum)}"
            )
        if warn_working_set and budget < working_set:
            warnings.warn(
                f"cache budget {format_size(budget)} is smaller than one token's working set over all layers "
                f"({format_size(working_set)}): expect most experts to be read again for every token",
                RuntimeWarning,
                stacklevel=3,
            )

    def _carve(self, budget: int, top_k: int, policy_factory: Callable[[], EvictionPolicy]):
        by_size: dict[int, list[Key]] = {}
        for key, parts in self.emap.units.items():
            by_size.setdefault(slot_bytes(parts), []).append(key)
        total = sum(size * len(keys) for size, keys in by_size.items())
        classes, class_of = [], {}
        for size, keys in sorted(by_size.items()):
            share = budget * size * len(keys) // total if len(by_size) > 1 else budget
            capacity = min(len(keys), max(top_k, share // size))
            cls = SizeClass(
                size, capacity, AlignedBuffer(size * capacity), ResidentSet(capacity, policy_factory())
            )
            classes.append(cls)
            class_of.update((key, cls) for key in keys)
        return classes, class_of

    @property
    def capacity(self) -> int:
        """Number of expert slots."""
        return sum(c.capacity for c in self.classes)

    @property
    def slot_bytes(self) -> int:
        """Bytes of the largest slot (what the budget is charged per expert)."""
        return max(c.slot_bytes for c in self.classes)

    @property
    def allocated_bytes(self) -> int:
        return sum(c.buffer.nbytes for c in self.classes)

    def open_layer(self, layer: int, experts: list[int]) -> "LayerJob":
        """Start one layer forward over `experts` (distinct, in execution order)."""
        self.last_job_seq = next(self._job_seq)
        job = LayerJob(self, layer, experts, self.last_job_seq)
        with self.lock:
            self._open_job = job
        return job

    def prefetch(self, layer: int, experts: list[int]) -> int:
        """Read ahead experts predicted for `layer`, after every read of the last opened layer job and before
        any of a later one. Only free or unpinned slots are used, never one of the open layer's or the
        other predicted experts; stops at the first victim in use. Returns the number of experts queued."""
        after_job = self.last_job_seq
        reads: list[Request] = []
        queued = 0
        open_keys = self._open_job.keys if self._open_job is not None else set()
        protected = open_keys | {(layer, e) for e in experts}
        with self.lock:
            for expert in experts:
                key = (layer, expert)
                if key in self._states:
                    continue
                if self._blocked(key, protected):
                    break
                reads.extend(
                    self._admit_miss(
                        key, None, queued, priority=(after_job, len(self.emap.kinds)), protected=protected
                    )
                )
                queued += 1
                state = self._states[key]
                state.prefetching = state.prefetched = True
                self._prefetching += 1
                self.stats.prefetches += 1
                self.stats.prefetch_bytes += self.emap.unit_bytes(layer, expert)
        self.reader.submit(reads)
        return queued

    def touch_if_resident(self, key: Key) -> None:
        """Count a use of `key` in the eviction order without reading or pinning it (a faster tier hit)."""
        with self.lock:
            if key in self._states:
                self._states[key].cls.residents.touch(key)

    def state_of(self, key: Key) -> SlotState:
        return self._states[key]

    def resident_keys(self) -> set[Key]:
        with self.lock:
            return {key for c in self.classes for key in c.residents._slot_of}

    # --- called with self.lock held -------------------------------------------------------------

    def _pin_hit(self, key: Key, job: "LayerJob") -> None:
        state = self._states[key]
        state.cls.residents.touch(key)
        if state.prefetched:
            state.prefetched = False
            self.stats.prefetch_used += 1
        state.pins += 1
        for kind in self.emap.kinds:
            if state.remaining[kind] == 0:
                job.events.put((key[1], kind, state.errors[kind]))
            else:
                state.listeners.append(job)

    def _blocked(self, key: Key, protected: set[Key]) -> bool:
        victim = self._class_of[key].residents.next_victim(_Unavailable(protected, self._states))
        return victim is not None and self._states[victim].pins > 0

    def _admit_miss(
        self,
        key: Key,
        job: "LayerJob | None",
        rank: int,
        priority: tuple | None = None,
        protected: set[Key] = frozenset(),
    ) -> list[Request]:
        cls = self._class_of[key]
        slot, evicted = cls.residents.admit(key, _Unavailable(protected, self._states))
        if evicted is not None:
            victim = self._states.pop(evicted)
            if self.on_evict is not None:
                self.on_evict(victim)
            self.stats.evictions += 1
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_parts(self.emap.kinds, self.emap.units[key])
        state = SlotState(
            key,
            cls,
            slot,
            plan,
            {},
            {k: None for k in self.emap.kinds},
            pins=1,
            listeners=[job] if job is not None else [],
        )
        self._states[key] = state
        reads = []
        for kind_rank, kind in enumerate(self.emap.kinds):
            order = (job.seq, kind_rank) if priority is None else priority
            kind_reads = self._kind_reads(state, kind, (*order, rank, kind_rank))
            state.remaining[kind] = len(kind_reads)
            reads.extend(kind_reads)
        return reads

    def _kind_reads(self, state: SlotState, kind: str, priority: tuple) -> list[Request]:
        """One read request per part of `kind` (the reader splits each into pieces)."""
        requests = []
        for part_rank, part in enumerate(state.plan[kind]):
            dest = state.base + part.region_offset
            requests.append(
                Request(
                    priority=(*priority, part_rank),
                    seq=self.reader.next_seq(),
                    file=self.reader.open(part.ref.file),
                    offset=part.file_offset,
                    length=part.length,
                    needed=part.head + part.ref.nbytes,
                    dest=state.cls.buffer.view[dest : dest + part.length],
                    dest_address=state.cls.buffer.address + dest,
                    piece=self.piece_bytes,
                    on_done=lambda err, s=state, k=kind: self._part_done(s, k, err),
                )
            )
        return requests

    def _part_done(self, state: SlotState, kind: str, error: BaseException | None) -> None:
        reads: list[Request] = []
        with self.lock:
            if error is not None and state.errors[kind] is None:
                state.errors[kind] = error
            state.remaining[kind] -= 1
            if state.remaining[kind] == 0:
                for job in state.listeners:
                    job.events.put((state.key[1], kind, state.errors[kind]))
                if state.prefetching and all(n == 0 for n in state.remaining.values()):
                    state.prefetching = False
                    self._prefetching -= 1
                    self._unpin(state)
                    open_job = self._open_job
                    if open_job is not None and open_job._pending:  # its next victim may have been this one
                        reads = open_job._admit_pending()
        if reads:
            self.reader.submit(reads)

    def _release(self, key: Key, job: "LayerJob") -> None:
        state = self._states[key]
        if job in state.listeners:
            state.listeners.remove(job)
        self._unpin(state)

    def _unpin(self, state: SlotState) -> None:
        state.pins -= 1
        if state.pins == 0 and state.failed and all(n == 0 for n in state.remaining.values()):
            state.cls.residents.remove(state.key)  # bad bytes must not be served as a hit later
            del self._states[state.key]


class _Unavailable:
    """Keys a new miss must not evict: the open layer's own experts, and any expert pinned right now (in
    use, or a prefetch still being read), while another key can go."""

    def __init__(self, protected: set[Key], states: dict[Key, SlotState]) -> None:
        self.protected, self.states = protected, states

    def __contains__(self, key: object) -> bool:
        state = self.states.get(key)  # type: ignore[arg-type]
        return key in self.protected or (state is not None and state.pins > 0)

    def __bool__(self) -> bool:
        return True


class LayerJob:
    """One layer forward's view of the cache: readiness events in, releases out."""

    def __init__(self, cache: ExpertCache, layer: int, experts: list[int], seq: int) -> None:
        self.cache, self.layer, self.seq = cache, layer, seq
        self.keys = {(layer, e) for e in experts}  # never evicted to make room for each other
        self.events: queue.SimpleQueue[tuple[int, str, BaseException | None]] = queue.SimpleQueue()
        self.hits: list[int] = []
        self.misses: list[int] = []
        self._pending: list[int] = []
        self._admitted = 0
        self._active = 0  # experts pinned by this job and not yet released
        self.wait_s = 0.0
        with cache.lock:
            for e in experts:
                (self.hits if (layer, e) in cache._states else self.misses).append(e)
            for e in self.hits:
                cache._pin_hit((layer, e), self)
            self._active = len(self.hits)
            cache.stats.hits += len(self.hits)
            cache.stats.misses += len(self.misses)
            cache.stats.miss_bytes += sum(cache.emap.unit_bytes(layer, e) for e in self.misses)
            self._pending = list(self.misses)
            reads = self._admit_pending()
        cache.reader.submit(reads)

    def _admit_pending(self) -> list[Request]:
        """Give slots to waiting misses, in order, while the next victim is not in use."""
        reads: list[Request] = []
        while self._pending and not self.cache._blocked((self.layer, self._pending[0]), self.keys):
            expert = self._pending.pop(0)
            reads.extend(
                self.cache._admit_miss((self.layer, expert), self, self._admitted, protected=self.keys)
            )
            self._admitted += 1
            self._active += 1
        return reads

    def next_event(self) -> tuple[int, str, BaseException | None]:
        """The next (expert, kind, error-or-None) whose bytes are in place; blocks while reads run."""
        try:
            return self.events.get_nowait()
        except queue.Empty:
            pass
        with self.cache.lock:  # a finishing prefetch admits the rest (under the lock, atomically)
            stuck = self._active == 0 and not self.cache._prefetching
        if stuck:
            raise RuntimeError(f"layer {self.layer} waits for an expert slot that nothing will release")
        start = time.perf_counter()
        event = self.events.get()
        waited = time.perf_counter() - start
        self.wait_s += waited
        with self.cache.lock:
            self.cache.stats.read_wait_s += waited
        return event

    def drop_pending(self) -> list[int]:
        """Give up on misses that never got a slot (after a failed read). Returns those experts."""
        with self.cache.lock:
            dropped, self._pending = self._pending, []
        return dropped

    def tensor_parts(self, expert: int, kind: str) -> list[tuple[AlignedBuffer, int, PartRead]]:
        """(buffer, offset of the tensor's first byte in it, part) for each part of a kind in its slot."""
        state = self.cache._states[(self.layer, expert)]
        return [(state.cls.buffer, state.base + p.region_offset + p.head, p) for p in state.plan[kind]]

    def release(self, expert: int) -> None:
        """The layer is done with `expert`: its slot may be evicted; waiting misses may proceed."""
        with self.cache.lock:
            self.cache._release((self.layer, expert), self)
            self._active -= 1
            reads = self._admit_pending()
        self.cache.reader.submit(reads)

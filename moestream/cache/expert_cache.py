"""The expert cache: a byte budget of locked slots, filled by the reader, evicted by the policy.

One owner: this object owns slot memory and decides (through `ResidentSet`) which expert sits where.
Compute asks for one layer at a time with `open_layer`, which returns a `LayerJob` that delivers one
readiness event per (expert, kind): at once for cached experts, when the last piece lands for misses.
All bookkeeping happens here, under one lock; callbacks of other owners (`on_evict`) run outside it.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import queue
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from moestream.cache.admission import Unavailable, admission_blocked
from moestream.cache.policy import EvictionPolicy, LRUPolicy, ResidentSet, slots_for_budget
from moestream.cache.slots import PartRead, Repack, plan_parts, region_bytes, slot_bytes
from moestream.errors import CacheBudgetError, ExpertReadError, MoestreamError
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
    listeners: list[LayerJob] = field(default_factory=list)
    # holds a pin of its own until its reads are done: a prefetch, or the reads of a forward that failed
    prefetching: bool = False
    prefetched: bool = False  # read ahead and not asked for yet
    addresses: dict[str, int] | None = None  # kind -> where its bytes are, once read (`pin_all_hits`)

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


def plan_classes(emap: ExpertMap, budget: int, top_k: int) -> list[tuple[int, int, list[Key]]]:
    """(slot bytes, slots, experts) of every size class a cache of `budget` bytes carves, before anything
    is allocated: each class gets its share of the budget, at least top_k slots, at most its experts."""
    by_size: dict[int, list[Key]] = {}
    for key, parts in emap.units.items():
        by_size.setdefault(slot_bytes(parts), []).append(key)
    total = sum(size * len(keys) for size, keys in by_size.items())
    plan = []
    for size, keys in sorted(by_size.items()):
        share = budget * size * len(keys) // total if len(by_size) > 1 else budget
        plan.append((size, slots_for_budget(share, size, floor=top_k, limit=len(keys)), keys))
    return plan


def planned_bytes(emap: ExpertMap, budget: int, top_k: int) -> int:
    """Bytes a cache of `budget` would allocate (less than the budget when every expert fits)."""
    return sum(size * capacity for size, capacity, _ in plan_classes(emap, budget, top_k))


_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class _BookkeepingLock:
    """The cache's lock; on the main thread it also holds SIGINT and SIGTERM back while held. Python
    raises KeyboardInterrupt between any two bytecodes of the main thread, and one raised between two
    steps of the bookkeeping (a slot given before its reads were counted, a pin taken and not recorded)
    left the cache inconsistent: the next request failed (`KeyError` in a hit's kinds, found by a Ctrl-C
    test). Held back, the signal is delivered when the lock is released, between two whole changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._masks = threading.local()

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._masks.saved = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        saved = getattr(self._masks, "saved", None)
        if saved is not None:
            self._masks.saved = None
            signal.pthread_sigmask(signal.SIG_SETMASK, saved)


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
        self.lock = _BookkeepingLock()
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
        held = collections.Counter(id(cls) for cls in self._class_of.values())
        self._holds_all = all(cls.capacity >= held[id(cls)] for cls in self.classes)
        self._repack: dict[tuple[int, str], Repack] = {}  # (layer, kind) -> how it is rewritten once read
        self._moved = self._layers_to_move()
        self.locked = all(c.buffer.lock() for c in self.classes) if lock_memory else False
        self.budget_bytes = budget_bytes
        self.closed = False
        self.version = 0  # bumped whenever a key enters or leaves a slot

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

    def _layers_to_move(self) -> frozenset[int]:
        """Layers whose experts' bytes start at different places in their slots (an expert's size not a
        multiple of 4 KiB puts each at another offset within its aligned read), each kind in one part:
        once a kind is read, its bytes are moved to the start of its region (`_part_done`), so every
        expert of the layer has each kind at the same offset in its slot and one ggml_mul_mat_id over
        the slots computes any of them. The other layers need no move."""
        heads: dict[int, set[tuple[int, ...]]] = {}
        single: dict[int, bool] = {}
        for (layer, _), parts in self.emap.units.items():
            plan = plan_parts(self.emap.kinds, parts)  # repacked kinds start at their region's start
            kept = [reads for kind, reads in plan.items() if (layer, kind) not in self._repack]
            heads.setdefault(layer, set()).add(tuple(p.head for reads in kept for p in reads))
            single[layer] = single.get(layer, True) and all(len(r) == 1 for r in kept)
        return frozenset(layer for layer, h in heads.items() if len(h) > 1 and single[layer])

    def repack(self, repacks: dict[tuple[int, str], Repack]) -> None:
        """Rewrite these (layer, kind)s once read, each as one part at its first region's start in the
        layout its kernels read (`Repack`); before any read, so every consumer sees the same bytes.

        Raises:
            ValueError: an expert is already read, or a rewritten kind would not fit its regions.
        """
        if self._states:
            raise ValueError("the cache's slot layout can only change before its first read")
        for (layer, e), parts in self.emap.units.items():
            for kind, refs in parts.items():
                r = repacks.get((layer, kind))
                if r is not None and r.nbytes > sum(region_bytes(ref.nbytes) for ref in refs):
                    raise ValueError(f"layer {layer} expert {e}: {kind} repacked needs {r.nbytes} bytes")
        self._repack = dict(repacks)
        self._moved = self._layers_to_move()

    def _start(self, layer: int, kind: str, reads: list[PartRead]) -> int | None:
        """Where a kind's bytes start in a slot once read, when they are one part (None: several)."""
        if (layer, kind) in self._repack:
            return reads[0].region_offset
        if len(reads) != 1:
            return None
        return reads[0].region_offset + self._head(layer, reads[0])

    def _head(self, layer: int, part: PartRead) -> int:
        """Where `part`'s bytes start in its region once read (0 where they were moved there)."""
        return 0 if layer in self._moved else part.head

    def _carve(self, budget: int, top_k: int, policy_factory: Callable[[], EvictionPolicy]):
        classes, class_of = [], {}
        for size, capacity, keys in plan_classes(self.emap, budget, top_k):
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

    def open_layer(
        self, layer: int, experts: list[int], uses: list[int] | None = None, tokens: int = 1
    ) -> LayerJob:
        """Start one layer forward over `experts` (distinct, in execution order; `uses[i]`: how many of
        the forward's `tokens` are routed to `experts[i]`): tell the policy (`ResidentSet.begin_group`),
        pin the hits (their events are queued at once), give slots to misses while the next victim is
        free, queue their reads. If this raises, the job holds nothing."""
        self._check_open()
        self.last_job_seq = next(self._job_seq)
        job = LayerJob(self, layer, experts, self.last_job_seq)
        try:
            with self.lock:
                self._open_job = job
                self._begin_group(layer, experts, uses, tokens)
                for e in experts:
                    (job.hits if (layer, e) in self._states else job.misses).append(e)
                for e in job.hits:
                    self._pin_hit((layer, e), job)
                self.stats.hits += len(job.hits)
                self.stats.misses += len(job.misses)
                self.stats.miss_bytes += sum(self.emap.unit_bytes(layer, e) for e in job.misses)
                job.pending = list(job.misses)
                admitted = self._admit_pending(job)
            self._submit(admitted)
        except BaseException:
            self.abandon(job)
            raise
        return job

    def holds_all(self) -> bool:
        """Whether every expert of the map has a slot of its own (nothing need ever be evicted): fixed
        when the classes are carved (each class gets at most its experts' slots)."""
        return self._holds_all

    def read_all(self) -> int:
        """Read every expert not yet in place, layer by layer (each layer's reads in flight together),
        when `holds_all`; the reads count as misses. Returns the bytes read. If this raises (a failed
        read), what was read stays and the cache stays usable."""
        if not self.holds_all():
            raise ValueError("read_all needs a slot for every expert")
        before = self.stats.miss_bytes
        kinds = len(self.emap.kinds)
        for layer in self.emap.layers:
            experts = sorted(e for (lay, e) in self.emap.units if lay == layer)
            job = self.open_layer(layer, experts)
            try:
                landed = dict.fromkeys(experts, 0)
                left = len(experts)
                while left:
                    expert, _, failure = job.next_event()
                    if failure is not None:
                        raise failure
                    landed[expert] += 1
                    if landed[expert] == kinds:
                        job.release(expert)
                        left -= 1
            except BaseException:
                self.abandon(job)
                raise
        return self.stats.miss_bytes - before

    def prefetch(self, layer: int, experts: list[int]) -> int:
        """Read ahead experts predicted for `layer`, after every read of the last opened layer job and before
        any of a later one. Only free or unpinned slots are used, never one of the open layer's or the
        other predicted experts; stops at the first victim in use. Returns the number of experts queued."""
        self._check_open()
        after_job = self.last_job_seq
        admitted = _Admitted()
        queued = 0
        with self.lock:
            open_keys = self._open_job.keys if self._open_job is not None else set()
            protected = open_keys | {(layer, e) for e in experts}
            for expert in experts:
                key = (layer, expert)
                if key in self._states:
                    continue
                if self._blocked(key, protected):
                    break
                self._admit_miss(
                    key,
                    None,
                    queued,
                    admitted,
                    priority=(after_job, len(self.emap.kinds)),
                    protected=protected,
                )
                queued += 1
                state = self._states[key]
                state.prefetching = state.prefetched = True
                self._prefetching += 1
                self.stats.prefetches += 1
                self.stats.prefetch_bytes += self.emap.unit_bytes(layer, expert)
        self._submit(admitted)
        return queued

    def pin_all_hits(
        self, layer: int, experts: list[int], uses: list[int], tokens: int, alignment: int = 1
    ) -> list[tuple[int, dict[str, int]]] | None:
        """A forward of `layer` over `experts` (distinct, in execution order; `uses[i]` of its `tokens`
        routed to `experts[i]`) when every one is in place, read in full, each kind in one part at an
        `alignment`-aligned address: what `open_layer` would do for them (the policy's `begin_group`,
        a touch and a pin per expert, the hits counted); returns each expert's (slot in its size
        class, address of each kind). None, having done nothing, when any is not so. Give the pins
        back with `unpin_hits`."""
        self._check_open()
        with self.lock:
            states = []
            for e in experts:
                state = self._states.get((layer, e))
                if state is None or self._addresses(state, alignment) is None:
                    return None
                states.append(state)
            self._begin_group(layer, experts, uses, tokens)
            for state in states:
                state.cls.residents.touch(state.key)
                if state.prefetched:
                    state.prefetched = False
                    self.stats.prefetch_used += 1
                state.pins += 1
            self.stats.hits += len(experts)
        return [(state.slot, state.addresses) for state in states]

    def _addresses(self, state: SlotState, alignment: int) -> dict[str, int] | None:
        """kind -> address of a fully read expert's one part of each kind (kept: a slot's bytes do not
        change until it is evicted), or None."""
        if state.addresses is None:
            if state.failed or any(state.remaining.values()):
                return None
            layer = state.key[0]
            starts = {kind: self._start(layer, kind, reads) for kind, reads in state.plan.items()}
            if None in starts.values():
                return None
            base = state.cls.buffer.address + state.base
            state.addresses = {kind: base + start for kind, start in starts.items()}
        if any(a % alignment for a in state.addresses.values()):
            return None
        return state.addresses

    def slot_arena(self, layer: int) -> tuple[int, int, int, dict[str, int]] | None:
        """(buffer address, slot bytes, slots, kind -> offset of its bytes in a slot) when every expert
        of `layer` sits in one size class with each kind, one part, at the same offset in its slot (a
        multiple of 4 KiB per expert keeps the file offsets' remainders equal; other layers' kinds are
        moved to their regions' starts once read, `_layers_to_move`); else None."""
        keys = [key for key in self.emap.units if key[0] == layer]
        classes = {id(self._class_of[key]) for key in keys}
        layouts = {
            tuple((kind, self._start(layer, kind, reads)) for kind, reads in plan.items())
            for plan in (plan_parts(self.emap.kinds, self.emap.units[key]) for key in keys)
        }
        if len(classes) != 1 or len(layouts) != 1:
            return None
        layout = next(iter(layouts))
        if any(off is None for _, off in layout):
            return None
        cls = self._class_of[keys[0]]
        return cls.buffer.address, cls.slot_bytes, cls.capacity, dict(layout)

    def first_slot(self, layer: int, experts: int) -> int | None:
        """The slot of `layer`'s expert 0 when each of its `experts` is read in full, expert e in slot
        first + e of the one size class, while the cache `holds_all` (so none is ever evicted: the slots
        stay until a key leaves, which bumps `version`); else None."""
        with self.lock:
            first = None
            for e in range(experts):
                state = self._states.get((layer, e))
                if state is None or self._addresses(state, 1) is None:
                    return None
                first = state.slot - e if first is None else first
                if state.slot != first + e:
                    return None
            return first

    def count_hits(self, hits: int) -> None:
        """Hits served without `open_layer` (every expert cached: one graph computed them)."""
        with self.lock:
            self.stats.hits += hits

    def unpin_hits(self, layer: int, experts: list[int]) -> None:
        """Give back the pins `pin_all_hits` took."""
        with self.lock:
            for e in experts:
                self._unpin(self._states[(layer, e)])

    def touch_if_resident(self, key: Key) -> None:
        """Count a use of `key` in the eviction order without reading or pinning it (a faster tier hit)."""
        with self.lock:
            if key in self._states:
                self._states[key].cls.residents.touch(key)

    def state_of(self, key: Key) -> SlotState:
        return self._states[key]

    def resident_keys(self) -> set[Key]:
        """Experts holding a slot (read, or being read)."""
        with self.lock:
            return set(self._states)

    def tensor_parts(self, key: Key, kind: str) -> list[tuple[AlignedBuffer, int, PartRead]]:
        """(buffer, offset of the tensor's first byte in it, part) for each part of a kind in its slot."""
        state = self._states[key]
        repack = self._repack.get((key[0], kind))
        if repack is not None:  # one part now, where the first one's region starts
            p = state.plan[kind][0]
            return [
                (
                    state.cls.buffer,
                    state.base + p.region_offset,
                    replace(p, ref=replace(p.ref, nbytes=repack.nbytes)),
                )
            ]
        return [
            (state.cls.buffer, state.base + p.region_offset + self._head(key[0], p), p)
            for p in state.plan[kind]
        ]

    def next_event(self, job: LayerJob) -> tuple[int, str, BaseException | None]:
        """The next (expert, kind, error-or-None) of `job` whose bytes are in place (blocks while reads
        run)."""
        try:
            return job.events.get_nowait()
        except queue.Empty:
            pass
        with self.lock:  # a finishing prefetch admits the rest (under the lock, atomically)
            stuck = not job.held and not self._prefetching
        if stuck:
            raise RuntimeError(f"layer {job.layer} waits for an expert slot that nothing will release")
        start = time.perf_counter()
        event = job.events.get()
        waited = time.perf_counter() - start
        job.wait_s += waited
        with self.lock:
            self.stats.read_wait_s += waited
        return event

    def release(self, job: LayerJob, expert: int) -> None:
        """The layer is done with `expert`: its slot may be evicted; waiting misses may proceed."""
        with self.lock:
            state = self._states[(job.layer, expert)]
            if job in state.listeners:
                state.listeners.remove(job)
            self._unpin(state)
            job.held.discard(expert)
            admitted = self._admit_pending(job)
        self._submit(admitted)

    def abandon(self, job: LayerJob) -> None:
        """A forward failed (an exception anywhere in it): give back at once everything `job` holds. Its
        waiting misses are dropped; an expert whose reads still run keeps one pin until they land (a slot
        must not be refilled under a read), every other pin of the job is released."""
        with self.lock:
            job.pending = []
            for expert in sorted(job.held):
                state = self._states.get((job.layer, expert))
                if state is None:
                    continue
                if job in state.listeners:
                    state.listeners.remove(job)
                if any(n > 0 for n in state.remaining.values()) and not state.prefetching:
                    state.prefetching = True  # the job's pin becomes the reads' own, released as they land
                    self._prefetching += 1
                else:
                    self._unpin(state)
            job.held.clear()
            if self._open_job is job:
                self._open_job = None

    def close(self) -> None:
        """Unlock and free the slot memory now. The reader must have stopped (no read may land later)."""
        with self.lock:
            self.closed = True
            self._states.clear()
            self._open_job = None
        for c in self.classes:
            c.buffer.free()
        self.locked = False

    def _check_open(self) -> None:
        if self.closed:
            raise MoestreamError("the expert cache is closed (the engine was closed)")

    def drop_pending(self, job: LayerJob) -> list[int]:
        """Give up on misses of `job` that never got a slot (after a failed read). Returns those experts."""
        with self.lock:
            dropped, job.pending = job.pending, []
        return dropped

    # --- called with self.lock held -------------------------------------------------------------

    def _begin_group(self, layer: int, experts: list[int], uses: list[int] | None, tokens: int) -> None:
        """Each size class's policy hears of the forward's keys that are its own, in order."""
        if len(self.classes) == 1:
            self.classes[0].residents.begin_group([(layer, e) for e in experts], uses, tokens)
            return
        for cls in self.classes:
            mine = [i for i, e in enumerate(experts) if self._class_of[(layer, e)] is cls]
            if mine:
                cls.residents.begin_group(
                    [(layer, experts[i]) for i in mine],
                    None if uses is None else [uses[i] for i in mine],
                    tokens,
                )

    def _pin_hit(self, key: Key, job: LayerJob) -> None:
        state = self._states[key]
        state.cls.residents.touch(key)
        if state.prefetched:
            state.prefetched = False
            self.stats.prefetch_used += 1
        state.pins += 1
        job.held.add(key[1])
        for kind in self.emap.kinds:
            if state.remaining[kind] == 0:
                job.events.put((key[1], kind, state.errors[kind]))
            else:
                state.listeners.append(job)

    def _admit_pending(self, job: LayerJob) -> _Admitted:
        """Give slots to the job's waiting misses, in order, while the next victim is not in use."""
        admitted = _Admitted()
        while job.pending and not self._blocked((job.layer, job.pending[0]), job.keys):
            expert = job.pending.pop(0)
            self._admit_miss((job.layer, expert), job, job.admitted, admitted, protected=job.keys)
            job.held.add(expert)
            job.admitted += 1
        return admitted

    def _blocked(self, key: Key, protected: set[Key]) -> bool:
        return admission_blocked(self._class_of[key].residents, protected, self._pinned)

    def _pinned(self, key: Key) -> bool:
        state = self._states.get(key)
        return state is not None and state.pins > 0

    def _admit_miss(
        self,
        key: Key,
        job: LayerJob | None,
        rank: int,
        admitted: _Admitted,
        priority: tuple | None = None,
        protected: set[Key] = frozenset(),
    ) -> None:
        cls = self._class_of[key]
        slot, evicted = cls.residents.admit(key, Unavailable(protected, self._pinned))
        if evicted is not None:
            admitted.evicted.append(self._states.pop(evicted))
            self.stats.evictions += 1
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_parts(self.emap.kinds, self.emap.units[key])
        self.version += 1
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
        for kind_rank, kind in enumerate(self.emap.kinds):
            order = (job.seq, kind_rank) if priority is None else priority
            kind_reads = self._kind_reads(state, kind, (*order, rank, kind_rank))
            state.remaining[kind] = len(kind_reads)
            admitted.reads.extend(kind_reads)

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

    def _unpin(self, state: SlotState) -> None:
        state.pins -= 1
        if state.pins == 0 and state.failed and all(n == 0 for n in state.remaining.values()):
            state.cls.residents.remove(state.key)  # bad bytes must not be served as a hit later
            del self._states[state.key]
            self.version += 1

    # --- called on I/O threads ------------------------------------------------------------------

    def _part_done(self, state: SlotState, kind: str, error: BaseException | None) -> None:
        repack = self._repack.get((state.key[0], kind))
        if repack is not None and error is None:
            with self.lock:  # the kind's last part: every byte of it is in
                last = state.remaining[kind] == 1 and state.errors[kind] is None
            if last:  # outside the lock (I/O threads convert in parallel); the slot stays: a read is counted
                error = self._convert(state, kind, repack)
        admitted = _Admitted()
        with self.lock:
            if error is not None and state.errors[kind] is None:
                state.errors[kind] = error
            state.remaining[kind] -= 1
            if state.remaining[kind] == 0:
                if state.errors[kind] is None and repack is None and state.key[0] in self._moved:
                    base = state.cls.buffer.address + state.base
                    for p in state.plan[kind]:  # to the region's start: the same offset in every slot
                        ctypes.memmove(base + p.region_offset, base + p.region_offset + p.head, p.ref.nbytes)
                for job in state.listeners:
                    job.events.put((state.key[1], kind, state.errors[kind]))
                if state.prefetching and all(n == 0 for n in state.remaining.values()):
                    state.prefetching = False
                    self._prefetching -= 1
                    self._unpin(state)
                    open_job = self._open_job
                    if open_job is not None and open_job.pending:  # its next victim may have been this one
                        admitted = self._admit_pending(open_job)
        self._submit(admitted)

    def _convert(self, state: SlotState, kind: str, repack: Repack) -> BaseException | None:
        """Rewrite a kind just read into its kernels' layout (`repack`); returns the failure, if any."""
        view, base = state.cls.buffer.view, state.base
        parts = [view[base + p.region_offset + p.head :][: p.ref.nbytes] for p in state.plan[kind]]
        start = base + state.plan[kind][0].region_offset
        try:
            repack.convert(parts, view[start : start + repack.nbytes])
        except Exception as exc:  # bad bytes must not be served: the waiting layer raises this
            return ExpertReadError(f"expert {state.key} {kind} could not be repacked ({exc})")
        return None

    def _submit(self, admitted: _Admitted) -> None:
        """Outside the lock: let the owner of evicted slots finish with them (CUDA: copies still reading
        them), then queue the reads that refill them. If that fails, no read was queued: each one is
        finished with the error, so no slot waits for bytes that will never come."""
        try:
            if self.on_evict is not None:
                for victim in admitted.evicted:
                    self.on_evict(victim)
            self.reader.submit(admitted.reads)
        except BaseException as exc:
            error = ExpertReadError(f"expert reads could not be queued ({type(exc).__name__}: {exc})")
            for request in admitted.reads:
                request.on_done(error)
            raise


@dataclass
class _Admitted:
    """What admitting misses under the lock produced: reads to queue and the states they evicted."""

    reads: list[Request] = field(default_factory=list)
    evicted: list[SlotState] = field(default_factory=list)


class LayerJob:
    """One layer forward's handle on the cache: readiness events in, releases out. Its fields are the
    cache's to change (under the cache lock); compute calls the methods."""

    def __init__(self, cache: ExpertCache, layer: int, experts: list[int], seq: int) -> None:
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

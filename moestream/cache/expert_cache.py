"""The expert cache: a byte budget of locked slots, filled by the reader, evicted by the policy.

One owner: this object owns slot memory and decides (through `ResidentSet`) which expert sits where.
Compute asks for one layer at a time with `open_layer`, which returns a `LayerJob` that delivers one
readiness event per (expert, kind): at once for cached experts, when the last piece lands for misses.
All bookkeeping happens here, under one lock; callbacks of other owners (`on_evict`) run outside it.

Its parts live beside it: the size classes carved from the budget (`size_classes.py`), the records it
keeps (`records.py`: `SlotState`, `LayerJob`, `CacheStats`), the lock (`bookkeeping_lock.py`), where a
kind's bytes sit once read and the moves and repacks that put them there (`slot_layout.py`), and the
queries of kernels that read the slots in place (`in_place.py`, its base class).
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable

from moestream.cache.admission import Unavailable, admission_blocked
from moestream.cache.bookkeeping_lock import BookkeepingLock
from moestream.cache.in_place import InPlaceSlots
from moestream.cache.policy import EvictionPolicy, LRUPolicy
from moestream.cache.records import Admitted, CacheStats, LayerJob, SlotState
from moestream.cache.size_classes import Key, begin_group, carve, check_budget, holds_all
from moestream.cache.slot_layout import SlotLayout
from moestream.cache.slots import PartRead, Repack
from moestream.errors import ExpertReadError, MoestreamError
from moestream.io.memory import AlignedBuffer
from moestream.io.reader import Reader
from moestream.store.experts import ExpertMap


class ExpertCache(InPlaceSlots):
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
        self.lock = BookkeepingLock()
        self.stats = CacheStats()
        self._job_seq = itertools.count()
        self.last_job_seq = -1
        self._states: dict[Key, SlotState] = {}
        self._prefetching = 0  # prefetched experts whose reads are still in flight (each holds a pin)
        # the last opened layer job (its experts are never its victims)
        self._open_job: LayerJob | None = None
        # called with the state of an evicted expert before its slot is refilled (CUDA: pending copies)
        self.on_evict: Callable[[SlotState], None] | None = None
        check_budget(emap, budget_bytes, top_k, warn_working_set)
        self.classes, self._class_of = carve(emap, budget_bytes, top_k, policy_factory)
        self._holds_all = holds_all(self.classes, self._class_of)
        self.layout = SlotLayout(emap)  # where each kind's bytes are in a slot, once read
        self.locked = all(c.buffer.lock() for c in self.classes) if lock_memory else False
        self.budget_bytes = budget_bytes
        self.closed = False
        self.version = 0  # bumped whenever a key enters or leaves a slot

    def repack(self, repacks: dict[tuple[int, str], Repack]) -> None:
        """Rewrite these (layer, kind)s once read, each as one part at its first region's start in the
        layout its kernels read (`Repack`); before any read, so every consumer sees the same bytes.

        Raises:
            ValueError: an expert is already read, or a rewritten kind would not fit its regions.
        """
        if self._states:
            raise ValueError("the cache's slot layout can only change before its first read")
        self.layout.set_repacks(repacks)

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
                begin_group(self.classes, self._class_of, layer, experts, uses, tokens)
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

    def prefetch(self, layer: int, experts: list[int]) -> int:
        """Read ahead experts predicted for `layer`, after every read of the last opened layer job and before
        any of a later one. Only free or unpinned slots are used, never one of the open layer's or the
        other predicted experts; stops at the first victim in use. Returns the number of experts queued."""
        self._check_open()
        after_job = self.last_job_seq
        admitted = Admitted()
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

    def demote(self, keys: list[Key]) -> None:
        """`keys` are held by a faster tier now (a GPU tier copied them in): those resident here are the
        first this cache evicts, so that it holds other experts (`ResidentSet.demote`)."""
        with self.lock:
            for key in keys:
                state = self._states.get(key)
                if state is not None:
                    state.cls.residents.demote(key)

    def keep(self, keys: list[Key]) -> None:
        """A use of each of `keys` still resident here, in the eviction order only (no read, no pin, no hit
        counted): a faster tier's hits (the torch GPU tier keeps their host copies warm), or what a GPU tier
        evicted (as a victim cache takes what the tier above lets go)."""
        with self.lock:
            for key in keys:
                state = self._states.get(key)
                if state is not None:
                    state.cls.residents.touch(key)

    def state_of(self, key: Key) -> SlotState:
        return self._states[key]

    def resident_keys(self) -> set[Key]:
        """Experts holding a slot (read, or being read)."""
        with self.lock:
            return set(self._states)

    def tensor_parts(self, key: Key, kind: str) -> list[tuple[AlignedBuffer, int, PartRead]]:
        """(buffer, offset of the tensor's first byte in it, part) for each part of a kind in its slot."""
        return self.layout.tensor_parts(self._states[key], kind)

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

    def _take_hit(self, state: SlotState) -> None:
        """A use of a resident expert: the policy hears of it, a prefetch is counted used, a pin taken."""
        state.cls.residents.touch(state.key)
        if state.prefetched:
            state.prefetched = False
            self.stats.prefetch_used += 1
        state.pins += 1

    def _pin_hit(self, key: Key, job: LayerJob) -> None:
        state = self._states[key]
        self._take_hit(state)
        job.held.add(key[1])
        for kind in self.emap.kinds:
            if state.remaining[kind] == 0:
                job.events.put((key[1], kind, state.errors[kind]))
        # a hit still being read (a prefetch in flight): told of each other kind as it lands, once (one
        # listener entry per job: each entry hears every kind, and `HeldExperts` counts its events)
        if any(state.remaining[kind] for kind in self.emap.kinds):
            state.listeners.append(job)

    def _admit_pending(self, job: LayerJob) -> Admitted:
        """Give slots to the job's waiting misses, in order, while the next victim is not in use."""
        admitted = Admitted()
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
        admitted: Admitted,
        priority: tuple | None = None,
        protected: set[Key] = frozenset(),
    ) -> None:
        cls = self._class_of[key]
        slot, evicted = cls.residents.admit(key, Unavailable(protected, self._pinned))
        if evicted is not None:
            admitted.evicted.append(self._states.pop(evicted))
            self.stats.evictions += 1
        plan = self.layout.plan(key)
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
            kind_reads = self.layout.requests(
                state, kind, (*order, rank, kind_rank), self.reader, self.piece_bytes, self._part_done
            )
            state.remaining[kind] = state.landing[kind] = len(kind_reads)
            admitted.reads.extend(kind_reads)

    def _unpin(self, state: SlotState) -> None:
        state.pins -= 1
        if state.pins == 0 and state.failed and all(n == 0 for n in state.remaining.values()):
            state.cls.residents.remove(state.key)  # bad bytes must not be served as a hit later
            del self._states[state.key]
            self.version += 1

    # --- called on I/O threads ------------------------------------------------------------------

    def _part_done(self, state: SlotState, kind: str, error: BaseException | None) -> None:
        repack = self.layout.repack_of(state.key[0], kind)
        if repack is not None:
            with self.lock:  # the kind's last part to land: every byte of it is in
                state.landing[kind] -= 1
                last = state.landing[kind] == 0 and error is None and state.errors[kind] is None
            if last:  # outside the lock (I/O threads convert in parallel); the slot stays: a read is counted
                error = self.layout.convert(state, kind, repack)
        admitted = Admitted()
        with self.lock:
            if error is not None and state.errors[kind] is None:
                state.errors[kind] = error
            state.remaining[kind] -= 1
            if state.remaining[kind] == 0:
                if state.errors[kind] is None:
                    self.layout.move_to_start(state, kind)
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

    def _submit(self, admitted: Admitted) -> None:
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

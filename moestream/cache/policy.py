"""Eviction policy and residency bookkeeping, in plain Python (no torch).

The engine's expert cache and the offline trace simulator both drive a `ResidentSet`, so a simulated
miss count and a measured one come from the very same decisions. Keys are `(layer, expert)` tuples.

Access protocol for one MoE layer forward (both engine and simulator follow it):
  1. `order = execution_order(rows)`: the distinct experts in first-appearance order;
  2. every key already resident is a hit and is touched, in that order;
  3. every other key is a miss and is admitted, in that order; when no slot is free the policy names
     a victim. The engine waits if that victim is still in use by the layer being computed (it never
     evicts a pinned slot); the simulator, where compute is instantaneous, evicts it at once.
"""

from __future__ import annotations

import heapq
import sys
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Container, Hashable, Iterable, Iterator
from typing import ClassVar

Key = Hashable


def execution_order(rows: Iterable[Iterable[int]]) -> list[int]:
    """Distinct experts of one layer forward, in first-appearance order (token-major, router order).

    Args:
        rows: for each token, its routed experts in router order.
    """
    seen: dict[int, None] = {}
    for row in rows:
        for expert in row:
            seen.setdefault(int(expert), None)
    return list(seen)


class EvictionPolicy(ABC):
    """Decides which resident key leaves when a new key needs a slot."""

    name: ClassVar[str] = "abstract"

    @abstractmethod
    def on_hit(self, key: Key) -> None:
        """A resident key was used again."""

    @abstractmethod
    def on_admit(self, key: Key) -> None:
        """A key became resident (a miss that got a slot)."""

    @abstractmethod
    def on_evict(self, key: Key) -> None:
        """A resident key lost its slot."""

    @abstractmethod
    def victim(self) -> Key:
        """The resident key to evict next. Called only when every slot is taken."""

    def ranked(self) -> Iterator[Key]:
        """Resident keys in eviction order, victim first (lazily). Policies that cannot rank give only
        their victim."""
        yield self.victim()


class LRUPolicy(EvictionPolicy):
    """Least recently used: the key whose last hit or admission is oldest leaves first."""

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def on_hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def on_admit(self, key: Key) -> None:
        self._order[key] = None

    def on_evict(self, key: Key) -> None:
        del self._order[key]

    def victim(self) -> Key:
        return next(iter(self._order))

    def ranked(self) -> Iterator[Key]:
        return iter(self._order)


class ResidentSet:
    """Which key holds which of `capacity` slots; the policy picks victims. Pure bookkeeping."""

    def __init__(self, capacity: int, policy: EvictionPolicy | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a resident set needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.policy = policy if policy is not None else LRUPolicy()
        self._slot_of: dict[Key, int] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first

    def __contains__(self, key: Key) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot_of(self, key: Key) -> int | None:
        """The slot holding `key`, or None when it is not resident."""
        return self._slot_of.get(key)

    def touch(self, key: Key) -> int:
        """Record a hit on a resident key; returns its slot."""
        self.policy.on_hit(key)
        return self._slot_of[key]

    def next_victim(self, protected: Container[Key] = ()) -> Key | None:
        """The key that admitting a new one would evict, or None while a slot is free: the first key in
        the policy's order that is not `protected` (the experts of the layer being computed, which it
        needs now), or the policy's own victim when every resident key is protected."""
        if self._free:
            return None
        if protected:
            for key in self.policy.ranked():
                if key not in protected:
                    return key
        return self.policy.victim()

    def admit(self, key: Key, protected: Container[Key] = ()) -> tuple[int, Key | None]:
        """Give `key` a slot, evicting `next_victim(protected)` when full. Returns (slot, evicted key or
        None)."""
        if key in self._slot_of:
            raise KeyError(f"{key!r} is already resident")
        evicted = None
        if not self._free:
            evicted = self.next_victim(protected)
            self.remove(evicted)
        slot = self._free.pop()
        self._slot_of[key] = slot
        self.policy.on_admit(key)
        return slot, evicted

    def remove(self, key: Key) -> None:
        """Drop a resident key (evicted, or its bytes turned out bad) and free its slot."""
        slot = self._slot_of.pop(key)
        self.policy.on_evict(key)
        self._free.append(slot)

    def access_group(self, keys: Iterable[Key]) -> tuple[list[Key], list[Key]]:
        """One layer forward with instantaneous compute: touch hits, then admit misses, never evicting
        one of the group's own keys while another key can go (as the engine, whose layer holds them
        pinned). Returns (hits, misses)."""
        keys = list(keys)
        hits = [k for k in keys if k in self._slot_of]
        misses = [k for k in keys if k not in self._slot_of]
        for key in hits:
            self.touch(key)
        group = set(keys)
        for key in misses:
            self.admit(key, group)
        return hits, misses


def slots_for_budget(budget_bytes: int, slot_bytes: int) -> int:
    """How many slots of `slot_bytes` a byte budget buys."""
    return budget_bytes // slot_bytes


# --- Policies for the simulator and the engine alike (added for issue 4) -----------------------------
# Each one implements `EvictionPolicy`, so `ResidentSet(capacity, SomePolicy(...))` works in both places.
# Heaps below use lazy deletion: a stale entry stays in the heap until it reaches the top, which keeps
# every hit O(log n) instead of re-sorting; `_compact` bounds the garbage.

_NEVER = sys.maxsize  # "next use" of a key that is never used again


class LFUPolicy(EvictionPolicy):
    """Least frequently used: the key with the fewest uses since the start leaves first; ties go to LRU.

    Use counts survive eviction (a key that was popular earlier is still ranked by its whole history),
    which is the "perfect LFU" variant; with counts reset on eviction, a returning key would always lose.
    """

    name: ClassVar[str] = "lfu"

    def __init__(self) -> None:
        self._count: dict[Key, int] = {}
        self._stamp: dict[Key, int] = {}  # resident key -> tick of its live heap entry
        self._heap: list[tuple[int, int, Key]] = []  # (uses, tick, key); ticks are unique
        self._tick = 0

    def _use(self, key: Key) -> None:
        self._tick += 1
        count = self._count.get(key, 0) + 1
        self._count[key] = count
        self._stamp[key] = self._tick
        heapq.heappush(self._heap, (count, self._tick, key))
        if len(self._heap) > 4 * len(self._stamp) + 64:
            self._heap = [e for e in self._heap if self._stamp.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def on_hit(self, key: Key) -> None:
        self._use(key)

    def on_admit(self, key: Key) -> None:
        self._use(key)

    def on_evict(self, key: Key) -> None:
        del self._stamp[key]

    def victim(self) -> Key:
        heap = self._heap
        while self._stamp.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2]

    def ranked(self) -> Iterator[Key]:
        live = [e for e in self._heap if self._stamp.get(e[2]) == e[1]]
        heapq.heapify(live)
        while live:
            yield heapq.heappop(live)[2]


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN (OPT): evicts the resident key whose next use lies farthest in the future.

    It needs the whole future, so it is a bound for the simulator, not a policy for a live engine.
    `groups` is the access sequence, one iterable of distinct keys per layer forward. Every `on_hit` or
    `on_admit` of a key consumes that key's next occurrence, so the policy must see each forward's keys
    exactly once, in forward order (which is what `ResidentSet.access_group` does).
    """

    name: ClassVar[str] = "opt"

    def __init__(self, groups: Iterable[Iterable[Key]]) -> None:
        self._uses: dict[Key, deque[int]] = {}
        for index, group in enumerate(groups):
            for key in group:
                self._uses.setdefault(key, deque()).append(index)
        self._next: dict[Key, int] = {}  # resident key -> index of its next use
        self._heap: list[tuple[int, int, Key]] = []  # (-next use, tie-breaker, key)
        self._tick = 0

    def _use(self, key: Key) -> None:
        pending = self._uses.get(key)
        if not pending:
            raise ValueError(f"{key!r} is used more often than the future given to BeladyPolicy says")
        pending.popleft()
        upcoming = pending[0] if pending else _NEVER
        self._next[key] = upcoming
        self._tick += 1
        heapq.heappush(self._heap, (-upcoming, self._tick, key))
        if len(self._heap) > 4 * len(self._next) + 64:
            self._heap = [e for e in self._heap if self._next.get(e[2]) == -e[0]]
            heapq.heapify(self._heap)

    def on_hit(self, key: Key) -> None:
        self._use(key)

    def on_admit(self, key: Key) -> None:
        self._use(key)

    def on_evict(self, key: Key) -> None:
        del self._next[key]

    def victim(self) -> Key:
        heap = self._heap
        while self._next.get(heap[0][2]) != -heap[0][0]:
            heapq.heappop(heap)
        return heap[0][2]


class StaticPolicy(EvictionPolicy):
    """Static pinning: the pinned keys never leave; the slots they leave free are shared in LRU order."""

    name: ClassVar[str] = "static"

    def __init__(self, pinned: Iterable[Key]) -> None:
        self.pinned = frozenset(pinned)
        self._lru = LRUPolicy()  # unpinned residents only

    def on_hit(self, key: Key) -> None:
        if key not in self.pinned:
            self._lru.on_hit(key)

    def on_admit(self, key: Key) -> None:
        if key not in self.pinned:
            self._lru.on_admit(key)

    def on_evict(self, key: Key) -> None:
        if key not in self.pinned:
            self._lru.on_evict(key)

    def victim(self) -> Key:
        try:
            return self._lru.victim()
        except StopIteration:
            raise LookupError("every slot holds a pinned key; none is left for streamed experts") from None


class PinnedResidentSet(ResidentSet):
    """Static pinning as the seed simulated it: the most frequent keys fill the slots before the first
    forward and stay. A key outside them is streamed (a miss); it is kept only in slots the pinned keys
    left free (LRU among those), and with every slot pinned it is read and dropped."""

    def __init__(self, capacity: int, ranked: Iterable[Key]) -> None:
        pinned = list(ranked)[:capacity]  # most valuable first
        super().__init__(capacity, StaticPolicy(pinned))
        for key in pinned:
            self.admit(key)
        self.streaming_slots = capacity - len(pinned)

    def access_group(self, keys: Iterable[Key]) -> tuple[list[Key], list[Key]]:
        """Touch hits, then admit misses while unpinned slots exist (else they bypass). Returns (hits,
        misses)."""
        keys = list(keys)
        hits = [k for k in keys if k in self]
        misses = [k for k in keys if k not in self]
        for key in hits:
            self.touch(key)
        if self.streaming_slots:
            for key in misses:
                self.admit(key)
        return hits, misses


class PartitionedLRUPolicy(EvictionPolicy):
    """Per-layer LRU: keys are `(layer, expert)`; each layer evicts only its own least recent key."""

    name: ClassVar[str] = "partitioned-lru"

    def __init__(self) -> None:
        self._per_layer: dict[Hashable, OrderedDict[Key, None]] = {}

    def on_hit(self, key: Key) -> None:
        self._per_layer[key[0]].move_to_end(key)  # type: ignore[index]

    def on_admit(self, key: Key) -> None:
        self._per_layer.setdefault(key[0], OrderedDict())[key] = None  # type: ignore[index]

    def on_evict(self, key: Key) -> None:
        del self._per_layer[key[0]][key]  # type: ignore[index]

    def resident_in(self, layer: Hashable) -> int:
        """How many keys of `layer` are resident."""
        return len(self._per_layer.get(layer, ()))

    def victim_in(self, layer: Hashable) -> Key:
        """The least recently used resident key of `layer`."""
        return next(iter(self._per_layer[layer]))

    def victim(self) -> Key:
        # Interface fallback (a plain ResidentSet has no quotas): the LRU key of the fullest layer.
        fullest = max(self._per_layer, key=lambda layer: len(self._per_layer[layer]))
        return self.victim_in(fullest)


class PartitionedResidentSet(ResidentSet):
    """Slots split between layers by fixed quotas, LRU within each layer. A layer with no quota streams."""

    def __init__(self, quotas: dict[Hashable, int]) -> None:
        super().__init__(max(1, sum(quotas.values())), PartitionedLRUPolicy())
        self.quotas = dict(quotas)

    def admit(self, key: Key, protected: Container[Key] = ()) -> tuple[int, Key | None]:
        """Give `key` a slot of its layer's share, evicting that layer's LRU key when the share is full."""
        layer = key[0]  # type: ignore[index]
        quota = self.quotas.get(layer, 0)
        if quota < 1:
            raise ValueError(f"layer {layer!r} has no slots in this partition")
        evicted = None
        if self.policy.resident_in(layer) >= quota:  # type: ignore[attr-defined]
            evicted = self.policy.victim_in(layer)  # type: ignore[attr-defined]
            self.remove(evicted)
        # under quota, the total is under capacity (quotas sum to it), so a slot is free: no eviction
        slot, _ = super().admit(key)
        return slot, evicted

    def access_group(self, keys: Iterable[Key]) -> tuple[list[Key], list[Key]]:
        """Touch hits, then admit misses of layers that own slots. Returns (hits, misses)."""
        keys = list(keys)
        hits = [k for k in keys if k in self]
        misses = [k for k in keys if k not in self]
        for key in hits:
            self.touch(key)
        for key in misses:
            if self.quotas.get(key[0], 0) > 0:  # type: ignore[index]
                self.admit(key)
        return hits, misses


def split_evenly(capacity: int, layers: Iterable[Hashable]) -> dict[Hashable, int]:
    """Per-layer quotas that sum to `capacity`; the first `capacity % n` layers get one slot more."""
    layers = list(layers)
    base, extra = divmod(capacity, len(layers))
    return {layer: base + (1 if i < extra else 0) for i, layer in enumerate(layers)}


def prefetch(resident: ResidentSet, keys: Iterable[Key]) -> list[Key]:
    """Admit every key that is not resident yet (one read each), in order; keys already resident are
    left untouched, so a prediction does not refresh their recency. Returns the admitted keys."""
    admitted = []
    for key in keys:
        if key not in resident:
            resident.admit(key)
            admitted.append(key)
    return admitted

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
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Sequence
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


def uses_of(experts: Iterable[int], rows: Iterable[Iterable[int]]) -> dict[int, int]:
    """How many tokens of `rows` (each token's routed experts) route to each of `experts`, in `experts`'
    order (an expert of `rows` not among them is not counted)."""
    uses = dict.fromkeys(experts, 0)
    for row in rows:
        for e in row:
            if e in uses:
                uses[e] += 1
    return uses


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

    def bind(self, capacity: int) -> None:
        """The `ResidentSet` this policy serves has `capacity` slots (called once, by the set)."""

    def on_group(self, keys: Sequence[Key], uses: Sequence[int] | None = None, tokens: int = 1) -> None:
        """A layer forward over `keys` (distinct, execution order) starts; its hits and misses follow.
        `uses[i]` is the number of the forward's `tokens` routed to `keys[i]` (None: one token). Policies
        that learn from routing override it; the others ignore it."""


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
        # Slots are handed out lazily (0, 1, 2, ...; a freed slot is reused first, last freed first), so
        # the memory held is bounded by the keys ever resident, not by the capacity: a simulated budget of
        # 1 TiB costs no more than one that holds every expert.
        self._freed: list[int] = []
        self._fresh = 0  # slots below this have been handed out at least once
        # keys a faster tier above holds (`demote`): the next victims, the latest demoted first (the tier
        # above keeps those longest), ahead of the policy's order, until used here again or removed
        self._demoted: dict[Key, None] = {}
        # where not None, each key an admission evicted is appended (a tier above gives them to the one
        # below, `GpuTier.take_evicted`)
        self.evicted: list[Key] | None = None
        self.policy.bind(capacity)

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
        if self._demoted:
            self._demoted.pop(key, None)
        return self._slot_of[key]

    def demote(self, key: Key) -> None:
        """A resident `key` is held by a faster tier above this one (a GPU tier copied it): evict it before
        any key the policy ranks, so that the two tiers hold different keys (exclusive caching) and add
        up. It stays a victim until touched (the tier above evicted it, or it is used here again) or
        removed. Policy-neutral: the policy's own order is kept for the other keys."""
        if key in self._slot_of:
            self._demoted[key] = None

    def next_victim(self, protected: Container[Key] = ()) -> Key | None:
        """The key that admitting a new one would evict, or None while a slot is free: the first key in
        the policy's order that is not `protected` (the experts of the layer being computed, which it
        needs now), or the policy's own victim when every resident key is protected."""
        if self.has_free_slot():
            return None
        for key in reversed(self._demoted):
            if key not in protected:
                return key
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
        if not self.has_free_slot():
            evicted = self.next_victim(protected)
            self.remove(evicted)
            if self.evicted is not None:
                self.evicted.append(evicted)
        if self._freed:
            slot = self._freed.pop()
        else:
            slot, self._fresh = self._fresh, self._fresh + 1
        self._slot_of[key] = slot
        self.policy.on_admit(key)
        return slot, evicted

    def has_free_slot(self) -> bool:
        """Whether admitting a key now would evict nothing."""
        return len(self._slot_of) < self.capacity

    def remove(self, key: Key) -> None:
        """Drop a resident key (evicted, or its bytes turned out bad) and free its slot."""
        slot = self._slot_of.pop(key)
        self.policy.on_evict(key)
        if self._demoted:
            self._demoted.pop(key, None)
        self._freed.append(slot)

    def keeps(self, key: Key) -> bool:
        """Whether a miss on `key` gets a slot (True here); subclasses that stream some keys without
        keeping them (every slot pinned, a layer without a quota) say False for those."""
        return True

    def begin_group(self, keys: Sequence[Key], uses: Sequence[int] | None = None, tokens: int = 1) -> None:
        """A layer forward over `keys` (distinct, in execution order) starts: tell the policy (see
        `EvictionPolicy.on_group`). Call it before the forward's touches and admissions; `access_group`
        does, and so must any other driver of this set (the engine's cache, when it opens a layer)."""
        self.policy.on_group(keys, uses, tokens)

    def access_group(
        self,
        keys: Iterable[Key],
        uses: Sequence[int] | None = None,
        tokens: int = 1,
        admits: Callable[[Key, Key | None], bool] | None = None,
    ) -> tuple[list[Key], list[Key]]:
        """One layer forward with instantaneous compute: `begin_group`, touch hits, then admit the misses
        that `keeps` allows, never evicting one of the group's own keys while another key can go (as the
        engine, whose layer holds them pinned). `admits(miss, victim)`: an admission rule besides (e.g.
        `admission.FrequencyGate`; victim None: a free slot); a miss it refuses stays out. Returns
        (hits, misses)."""
        keys = list(keys)
        policy = self.policy
        policy.on_group(keys, uses, tokens)
        slot_of = self._slot_of
        hits, misses = [], []
        for key in keys:
            (hits if key in slot_of else misses).append(key)
        for key in hits:  # `touch`, without its slot
            policy.on_hit(key)
        if self._demoted:
            for key in hits:
                self._demoted.pop(key, None)
        if not misses:
            return hits, misses
        group = set(keys)
        for key in misses:
            if self.keeps(key) and (admits is None or admits(key, self.next_victim(group))):
                self.admit(key, group)
        return hits, misses


def slots_for_budget(budget_bytes: int, slot_bytes: int, *, floor: int = 0, limit: int | None = None) -> int:
    """How many slots of `slot_bytes` a byte budget buys: `budget_bytes // slot_bytes`, raised to `floor`
    and capped at `limit` (the number of keys that could ever be resident; None: no cap). The one place
    where a budget becomes a slot count, for the simulator and the engine's tiers alike; callers decide
    what a result too small for them means (the simulator refuses 0 slots, a tier fewer than top_k)."""
    if slot_bytes < 1:
        raise ValueError(f"a slot must hold at least one byte, got {slot_bytes}")
    slots = max(floor, budget_bytes // slot_bytes)
    return slots if limit is None else min(slots, limit)


# --- Policies for the simulator and the engine alike -----------------------------------------------
# Each one implements `EvictionPolicy`, so `ResidentSet(capacity, SomePolicy(...))` works in both places.

_NEVER = sys.maxsize  # "next use" of a key that is never used again
Priority = int | tuple[int, ...]  # what `LazyHeap` orders by (tuples compare item by item)


class LazyHeap:
    """Resident keys by priority, smallest first, with lazy deletion: re-ranking or dropping a key leaves
    its old entry in the heap, skipped when it reaches the top, so every update is O(log n) instead of a
    re-sort. Garbage is compacted once it outnumbers the live entries four to one. Ties between equal
    priorities go to the key ranked earlier."""

    def __init__(self) -> None:
        self._heap: list[tuple[Priority, int, Key]] = []  # (priority, tick, key); ticks are unique
        self._live: dict[Key, int] = {}  # key -> tick of its live entry
        self._tick = 0

    def __len__(self) -> int:
        return len(self._live)

    def rank(self, key: Key, priority: Priority) -> None:
        """Give `key` (new or not) this priority."""
        self._tick += 1
        self._live[key] = self._tick
        heapq.heappush(self._heap, (priority, self._tick, key))
        if len(self._heap) > 4 * len(self._live) + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
        heapq.heapify(self._heap)

    def discard(self, key: Key) -> None:
        """Forget `key`."""
        del self._live[key]

    def first(self) -> Key:
        """The key with the smallest priority."""
        heap, live = self._heap, self._live
        while live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2]

    def ordered(self) -> Iterator[Key]:
        """Every key, smallest priority first, lazily: the m first keys cost O(m log m) (a walk down the
        heap's tree with a frontier heap of positions), not a sort. Valid until the next `rank`/`discard`."""
        if len(self._heap) > 2 * len(self._live) + 64:  # stale entries would be walked through: drop them
            self._compact()
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)
        if not heap:
            return
        frontier = [(heap[0], 0)]
        while frontier:
            entry, at = heapq.heappop(frontier)
            if live.get(entry[2]) == entry[1]:
                yield entry[2]
            for child in (2 * at + 1, 2 * at + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))


class LFUPolicy(EvictionPolicy):
    """Least frequently used: the key with the fewest uses since the start leaves first; ties go to LRU.

    Use counts survive eviction (a key that was popular earlier is still ranked by its whole history),
    which is the "perfect LFU" variant; with counts reset on eviction, a returning key would always lose.
    """

    name: ClassVar[str] = "lfu"

    def __init__(self) -> None:
        self._count: dict[Key, int] = {}
        self._heap = LazyHeap()  # resident keys by use count, ties by the tick of their last use

    def _use(self, key: Key) -> None:
        count = self._count.get(key, 0) + 1
        self._count[key] = count
        self._heap.rank(key, count)

    def on_hit(self, key: Key) -> None:
        self._use(key)

    def on_admit(self, key: Key) -> None:
        self._use(key)

    def on_evict(self, key: Key) -> None:
        self._heap.discard(key)

    def victim(self) -> Key:
        return self._heap.first()

    def ranked(self) -> Iterator[Key]:
        return self._heap.ordered()


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
        self._heap = LazyHeap()  # resident keys by -(index of their next use): the farthest first

    def _use(self, key: Key) -> None:
        pending = self._uses.get(key)
        if not pending:
            raise ValueError(f"{key!r} is used more often than the future given to BeladyPolicy says")
        pending.popleft()
        self._heap.rank(key, -(pending[0] if pending else _NEVER))

    def on_hit(self, key: Key) -> None:
        self._use(key)

    def on_admit(self, key: Key) -> None:
        self._use(key)

    def on_evict(self, key: Key) -> None:
        self._heap.discard(key)

    def victim(self) -> Key:
        return self._heap.first()


def prefetch(resident: ResidentSet, keys: Iterable[Key]) -> list[Key]:
    """Admit every key that is not resident yet (one read each), in order; keys already resident are
    left untouched, so a prediction does not refresh their recency. Returns the admitted keys."""
    admitted = []
    for key in keys:
        if key not in resident:
            resident.admit(key)
            admitted.append(key)
    return admitted

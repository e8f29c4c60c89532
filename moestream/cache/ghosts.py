"""The predictive policy's ghost caches (`moestream.cache.predictive`): shadow caches of the policy's
capacity that hold keys, not bytes, each evicting by one ranking, so that the policy can follow whichever
misses least. Keys are dense indices (`RoutingStats.index`).

Every ghost replays a forward the same way: its victims are taken outside the forward's own keys, in the
ranking's order; a forward larger than the cache keeps its last keys; the forward touches its hits, then
its misses (the order LRU and LFU's ties go by).

Plain Python over numpy (no torch).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Container

import numpy as np

from moestream.cache.policy import Priority
from moestream.cache.routing_stats import RoutingStats


class KeySet:
    """A set of dense keys that keeps a numpy array of them too, for rankings computed over the set: add
    and remove are O(1) (a removed key's place is taken by the last one)."""

    def __init__(self, size: int) -> None:
        """`size`: the most keys the set will hold at once."""
        # key -> its place in the array; hot loops test membership and size on it directly (a dict's
        # `in` and `len` cost a fraction of a Python-level __contains__ and __len__)
        self.where: dict[int, int] = {}
        self._keys: list[int] = []
        self._array = np.zeros(max(1, size), dtype=np.int64)

    def add(self, key: int) -> None:
        """Add a key that is not in the set."""
        self.where[key] = len(self._keys)
        self._array[len(self._keys)] = key
        self._keys.append(key)

    def remove(self, key: int) -> None:
        """Remove a key of the set."""
        place, last = self.where.pop(key), self._keys.pop()
        if last != key:
            self._keys[place] = last
            self._array[place] = last
            self.where[last] = place

    def array(self) -> np.ndarray:
        """The keys as an array (a view, valid until the next change)."""
        return self._array[: len(self._keys)]


class LRUGhost:
    """A ghost that evicts the key least recently touched."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()  # oldest touch first

    def access(self, idx: list[int], forward: frozenset[int], stats: RoutingStats) -> int:
        """Replay one forward (`idx`, as a set `forward`); returns its misses."""
        keys = self._keys
        missed = [i for i in idx if i not in keys]
        overflow = len(keys) + len(missed) - self.capacity
        if overflow > 0:
            victims = []
            for i in keys:
                if i not in forward:
                    victims.append(i)
                    if len(victims) == overflow:
                        break
            for i in victims:
                del keys[i]
            overflow -= len(victims)
        for i in idx:
            if i in keys:
                keys.move_to_end(i)
        for i in missed[max(0, overflow) :]:
            keys[i] = None
        return len(missed)


class RisingHeap:
    """Keys by a priority that only rises while they are held (a use count, a touch clock), smallest
    first, without a heap push at every rise: each key held has one live entry, pushed with its priority
    of then, which is at most its priority now (`current(key)`); an entry whose priority is outdated is
    pushed again with the current one only when it reaches the top. So an entry at the top that is up to
    date is the smallest of all current priorities. Entries of keys dropped, or replaced, are skipped
    (a tick tells an entry from an older one of the same key and priority)."""

    def __init__(self, current: Callable[[int], Priority]) -> None:
        self.current = current
        self.live: dict[int, int] = {}  # held key -> the tick of its live entry
        self._heap: list[tuple[Priority, int, int]] = []  # (priority, tick, key)
        self._tick = 0

    def push(self, key: int) -> None:
        """Hold `key` (not held yet) at its current priority."""
        self._tick += 1
        self.live[key] = self._tick
        heapq.heappush(self._heap, (self.current(key), self._tick, key))
        if len(self._heap) > 2 * len(self.live) + 64:  # mostly dead entries: rebuild from the live ones
            self._heap = [(self.current(i), t, i) for i, t in self.live.items()]
            heapq.heapify(self._heap)

    def drop(self, key: int) -> None:
        """Stop holding `key`."""
        del self.live[key]

    def smallest(self, n: int, skip: Container[int] = (), *, take: bool = False) -> list[int]:
        """The `n` held keys of smallest current priority outside `skip` (fewer when there are fewer),
        smallest first; with `take`, they are dropped too. Keys popped on the way are pushed back."""
        heap, live, current = self._heap, self.live, self.current
        out, back = [], []
        while heap and len(out) < n:
            entry = heapq.heappop(heap)
            priority, tick, key = entry
            if live.get(key) != tick:
                continue  # dropped, or replaced by a newer entry
            now = current(key)
            if now != priority:  # it rose since: back in at its place
                self._tick += 1
                live[key] = self._tick
                heapq.heappush(heap, (now, self._tick, key))
            elif key in skip:
                back.append(entry)
            else:
                out.append(key)
                if take:
                    del live[key]
                else:
                    back.append(entry)
        for entry in back:
            heapq.heappush(heap, entry)
        return out


class LFUGhost:
    """A ghost that evicts the key used by the fewest forwards since the start (ties: least recently
    touched in this ghost)."""

    def __init__(self, capacity: int, stats: RoutingStats) -> None:
        self.capacity = capacity
        self._touch: dict[int, int] = {}  # key -> its last touch in this ghost
        uses, touch = stats.uses, self._touch
        self._held = RisingHeap(lambda i: (uses[i], touch[i]))
        self._clock = 0

    def access(self, idx: list[int], forward: frozenset[int], stats: RoutingStats) -> int:
        """Replay one forward (its uses already counted in `stats`); returns its misses."""
        held, touch = self._held, self._touch
        hits = [i for i in idx if i in held.live]
        missed = [i for i in idx if i not in held.live]
        overflow = len(held.live) + len(missed) - self.capacity
        if overflow > 0:
            overflow -= len(held.smallest(overflow, forward, take=True))
        kept = missed[max(0, overflow) :]
        clock = self._clock
        for i in hits:  # their priority rises: the heap learns it when they reach its top
            clock += 1
            touch[i] = clock
        for i in kept:
            clock += 1
            touch[i] = clock
            held.push(i)
        self._clock = clock
        return len(missed)


class PredictiveGhost:
    """A ghost that evicts the key of lowest keep value (`RoutingStats.lowest`)."""

    def __init__(self, capacity: int, n_keys: int) -> None:
        self.capacity = capacity
        self._keys = KeySet(min(capacity, n_keys))

    def access(self, idx: list[int], forward: frozenset[int], stats: RoutingStats) -> int:
        """Replay one forward; returns its misses."""
        keys = self._keys
        where = keys.where
        missed = [i for i in idx if i not in where]
        overflow = len(where) + len(missed) - self.capacity
        if overflow > 0:  # victims outside the forward's own keys, which it needs now
            others = len(where) - (len(idx) - len(missed))
            victims = (
                stats.lowest(keys.array(), min(overflow, others), outside_forward=True) if others else []
            )
            for i in victims:
                keys.remove(i)
            overflow -= len(victims)
        for i in missed[max(0, overflow) :]:
            keys.add(i)
        return len(missed)

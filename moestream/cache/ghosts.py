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

import numpy as np

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


class LFUGhost:
    """A ghost that evicts the key used by the fewest forwards since the start (ties: least recently
    touched in this ghost). A heap with lazy deletion: a key's entry is live while it holds the key's
    last touch."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._touch: dict[int, int] = {}  # key -> its last touch, for every key held
        self._heap: list[tuple[int, int, int]] = []  # (uses, touch, key)
        self._clock = 0

    def access(self, idx: list[int], forward: frozenset[int], stats: RoutingStats) -> int:
        """Replay one forward (its uses already counted in `stats`); returns its misses."""
        touch = self._touch
        hits = [i for i in idx if i in touch]
        missed = [i for i in idx if i not in touch]
        overflow = len(touch) + len(missed) - self.capacity
        if overflow > 0:
            overflow -= self._evict(overflow, forward)
        kept = missed[max(0, overflow) :]
        uses, clock, heap = stats.uses, self._clock, self._heap
        for i in hits:
            clock += 1
            touch[i] = clock
            heapq.heappush(heap, (uses[i], clock, i))
        for i in kept:
            clock += 1
            touch[i] = clock
            heapq.heappush(heap, (uses[i], clock, i))
        self._clock = clock
        if len(heap) > 4 * len(touch) + 64:  # mostly dead entries: rebuild from the live ones
            self._heap = [(uses[i], t, i) for i, t in touch.items()]
            heapq.heapify(self._heap)
        return len(missed)

    def _evict(self, count: int, forward: frozenset[int]) -> int:
        """Drop up to `count` keys outside `forward`, fewest uses first. Returns how many it dropped. The
        forward's keys met on the way lose their entry: the forward touches them again right after."""
        heap, touch, dropped = self._heap, self._touch, 0
        while dropped < count and heap:
            _, t, i = heapq.heappop(heap)
            if touch.get(i) == t and i not in forward:
                del touch[i]
                dropped += 1
        return dropped


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
        if overflow > 0:
            hits = [i for i in idx if i in where]
            for i in hits:  # ranked without the forward's own keys, which it needs now
                keys.remove(i)
            victims = stats.lowest(keys.array(), overflow)
            for i in victims:
                keys.remove(i)
            for i in hits:
                keys.add(i)
            overflow -= len(victims)
        for i in missed[max(0, overflow) :]:
            keys.add(i)
        return len(missed)

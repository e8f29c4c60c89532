"""Slot layouts the seed simulated, beside the engine's shared cache: static pinning and per-layer
quotas (plain Python, for the trace simulator; the engine runs `moestream.cache.policy`'s policies).

Both are `ResidentSet`s whose `keeps` says which misses get a slot, so `access_group` drives them like
any other set.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable
from typing import ClassVar

from moestream.cache.policy import EvictionPolicy, Key, LRUPolicy, ResidentSet


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

    def keeps(self, key: Key) -> bool:
        """Misses are kept while unpinned slots exist; with every slot pinned they are read and dropped."""
        return self.streaming_slots > 0


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

    def keeps(self, key: Key) -> bool:
        """Only layers that own slots keep their misses."""
        return self.quotas.get(key[0], 0) > 0  # type: ignore[index]


def split_evenly(capacity: int, layers: Iterable[Hashable]) -> dict[Hashable, int]:
    """Per-layer quotas that sum to `capacity`; the first `capacity % n` layers get one slot more."""
    layers = list(layers)
    base, extra = divmod(capacity, len(layers))
    return {layer: base + (1 if i < extra else 0) for i, layer in enumerate(layers)}

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

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterable
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

    def next_victim(self) -> Key | None:
        """The key that admitting a new one would evict, or None while a slot is free."""
        return None if self._free else self.policy.victim()

    def admit(self, key: Key) -> tuple[int, Key | None]:
        """Give `key` a slot, evicting the policy's victim when full. Returns (slot, evicted key or None)."""
        if key in self._slot_of:
            raise KeyError(f"{key!r} is already resident")
        evicted = None
        if not self._free:
            evicted = self.policy.victim()
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
        """One layer forward with instantaneous compute: touch hits, then admit misses. Returns (hits, misses)."""
        keys = list(keys)
        hits = [k for k in keys if k in self._slot_of]
        misses = [k for k in keys if k not in self._slot_of]
        for key in hits:
            self.touch(key)
        for key in misses:
            self.admit(key)
        return hits, misses


def slots_for_budget(budget_bytes: int, slot_bytes: int) -> int:
    """How many slots of `slot_bytes` a byte budget buys."""
    return budget_bytes // slot_bytes

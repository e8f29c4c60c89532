"""The admission rule shared by every slot tier (the host cache and the GPU tier): plain Python.

A miss takes the slot of the first key in the policy's order that is neither protected (the experts
of the layer being computed, which it needs now) nor pinned (in use, or a prefetch still being read),
while such a key exists. When the key that would be evicted is still pinned, admission must wait until
it is released.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable

from moestream.cache.policy import ResidentSet

Key = Hashable


class Unavailable:
    """Keys a new miss must not evict while another can go: `protected` ones, and pinned ones."""

    def __init__(self, protected: Container[Key], pinned: Callable[[Key], bool]) -> None:
        self.protected, self.pinned = protected, pinned

    def __contains__(self, key: object) -> bool:
        return key in self.protected or self.pinned(key)

    def __bool__(self) -> bool:
        return True


def admission_blocked(
    residents: ResidentSet, protected: Container[Key], pinned: Callable[[Key], bool]
) -> bool:
    """Whether admitting one more key now would have to evict a pinned key (so it must wait)."""
    victim = residents.next_victim(Unavailable(protected, pinned))
    return victim is not None and pinned(victim)

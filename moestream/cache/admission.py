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


class FrequencyGate:
    """Admission by use counts (TinyLFU's rule, counted exactly): a miss takes the slot of the key the
    policy would evict only when it was used more than `ratio` times as often; a free slot takes any.

    For a tier whose misses are served without a slot (a GPU tier whose misses the CPU computes): there
    an admission is a copy that serves no token now, only later hits, so only a key clearly hotter than
    its victim gets in. Under routing that is close to uniform the tier's content then settles instead
    of turning over every token (each miss copied in to evict another expert as likely to be used);
    under skewed routing the hot experts still get in."""

    def __init__(self, ratio: float = 2.0) -> None:
        self.ratio = ratio
        self.uses: dict[Key, int] = {}

    def count(self, keys: list[Key], uses: list[int]) -> None:
        """A forward routed `uses[i]` tokens to `keys[i]`."""
        counts = self.uses
        get = counts.get
        for key, n in zip(keys, uses):
            counts[key] = get(key, 0) + n

    def admits(self, key: Key, victim: Key | None) -> bool:
        """Whether `key` may take `victim`'s slot (None: a free slot)."""
        return victim is None or self.uses.get(key, 0) > self.ratio * self.uses.get(victim, 0)

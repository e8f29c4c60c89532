"""A GPU tier in front of a host cache, in plain Python: what the simulator replays for `simulate
--gpu-tier` (the decisions `engine/tiered_steps.py` makes with a GPU tier whose misses are copied in,
the way `upload`, through the same classes).

Per layer forward: the tier hears of the group first (its `FrequencyGate` counts the uses, then
`ResidentSet.access_group`); its misses go to the host cache, which reads from disk those it lacks. Where
the host cache cannot hold every expert the two are exclusive, as the engine makes them: the tier
admits a miss only as its gate allows (a free slot, or used more than twice as often as its victim),
the misses it keeps out pass through its spare slots (`spare`, top_k a class in the engine: they take
no resident's place; more than that, a prefill chunk's, are admitted), each miss it admits is demoted
in the host cache (its next victim), and each expert it evicts is kept there as used now where still
held. Where the host cache holds every expert every miss is admitted, as the engine does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from moestream.cache.admission import FrequencyGate
from moestream.cache.policy import EvictionPolicy, Key, ResidentSet


def lent_slots(slots: int, spare: int) -> int:
    """How many of a tier class's `slots` are kept out of its residents for misses passing through (`spare`
    asked): all of them where the class has at least twice as many slots, else none."""
    return spare if spare and slots >= 2 * spare else 0


class TieredResidentSet:
    """A host `ResidentSet` of `capacity` slots behind a GPU tier of `tier_slots` (`spare` of them lent
    to misses the gate keeps out, where the tier has at least twice as many), both with `policy()`.
    `access_group` has the simulator's protocol: (hits, misses), a hit being a key that either tier
    held (nothing read), a miss one read from disk; `tier_hits` and `lent` count the tier's part."""

    def __init__(
        self,
        capacity: int,
        tier_slots: int,
        policy: Callable[[], EvictionPolicy],
        *,
        spare: int,
        exclusive: bool,
    ) -> None:
        self.capacity = capacity
        self.spare = lent_slots(tier_slots, spare) if exclusive else 0
        self.exclusive = exclusive
        self.host = ResidentSet(capacity, policy())
        self.tier = ResidentSet(tier_slots - self.spare, policy())
        self.gate = FrequencyGate()
        if exclusive:
            self.tier.evicted = []
        self.tier_hits = 0
        self.lent = 0

    def access_group(
        self, keys: Sequence[Key], uses: Sequence[int] | None = None, tokens: int = 1
    ) -> tuple[list[Key], list[Key]]:
        keys = list(keys)
        tier = self.tier
        if len(keys) > tier.capacity:  # more than the tier holds (a prefill chunk's): the host computes
            hits, misses = self.host.access_group(keys, uses, tokens)
            self._demote_held(keys)
            return hits, misses
        self.gate.count(keys, list(uses) if uses is not None else [1] * len(keys))
        admits = self.gate.admits if self.exclusive and self.spare else None
        tier_hits, tier_misses = tier.access_group(keys, uses, tokens, admits)
        refused = [key for key in tier_misses if key not in tier]
        if refused:
            if len(refused) <= self.spare:
                self.lent += len(refused)
            else:  # more than the spare slots: admitted, as the engine's `GpuTier.admit`
                group = set(keys)
                for key in refused:
                    tier.admit(key, group)
        if self.exclusive and tier.evicted:
            for key in tier.evicted:
                if key in self.host:
                    self.host.touch(key)
            tier.evicted.clear()
        host_uses = None
        if uses is not None:
            at = dict(zip(keys, uses))
            host_uses = [at[key] for key in tier_misses]
        host_hits, from_disk = self.host.access_group(tier_misses, host_uses, tokens)
        if self.exclusive:
            kept = set(refused) if len(refused) <= self.spare else set()
            for key in tier_misses:
                if key not in kept and key in tier:
                    self.host.demote(key)
        self.tier_hits += len(tier_hits)
        return tier_hits + host_hits, from_disk

    def _demote_held(self, keys: list[Key]) -> None:
        """After the host computed a group itself: those the tier holds are its own again (exclusive)."""
        if self.exclusive:
            for key in keys:
                if key in self.tier:
                    self.host.demote(key)

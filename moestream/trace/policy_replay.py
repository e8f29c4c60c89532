"""Driving the engine's resident sets and policies through a replay, forward by forward: the per-budget
replay (`run_policy`) and many capacities of one policy (`run_capacities`).

LRU runs every capacity in one pass (`moestream.trace.lru_stack`, checked against `run_policy` in the
tests). The predictive policies learn the same things at every capacity, so their capacities run in
lockstep, a few dozen at a time, sharing one `RoutingStats` that learns each forward once. The other
policies replay each capacity on its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moestream.cache.partitions import PartitionedResidentSet, PinnedResidentSet, split_evenly
from moestream.cache.policy import BeladyPolicy, LFUPolicy, LRUPolicy, ResidentSet, prefetch
from moestream.cache.predictive import PredictivePolicy, RoutingStats
from moestream.cache.tiers import TieredResidentSet
from moestream.trace.lru_stack import lru_counts
from moestream.trace.replay import Key, Replay

_COUNTERS = ("hits", "misses", "bytes_read", "prefetch_bytes", "prefetched", "prefetch_used", "tier_hits")
LOCKSTEP = 64  # capacities of a predictive policy replayed together (bounds the memory of their sets)
Uses = list[tuple[list[int], int]]


@dataclass
class Counters:
    """What one policy did in one cell (half x phase), summed over its forwards."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0  # demand misses + prefetches
    prefetch_bytes: int = 0
    prefetched: int = 0
    prefetch_used: int = 0  # prefetched keys that the forward they were fetched for hit
    tier_hits: int = 0  # of the hits, those a GPU tier in front held (`simulate --gpu-tier`)

    def __iadd__(self, other: Counters) -> Counters:
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def run_policy(replay: Replay, policy: str, capacity: int, unit: list[int]) -> list[Counters]:
    """Replay every forward through `policy` with `capacity` slots. Returns Counters per cell (0..3).

    Args:
        unit: bytes read per expert miss, indexed by layer.
    """
    return _replay(replay, policy, [capacity], unit)[0]


@dataclass(frozen=True)
class Tier:
    """A GPU tier in front of every budget's host cache (`TieredResidentSet`): its slots, the spare ones
    (top_k), and from which host capacity the host cache holds every expert (the tiers then inclusive)."""

    slots: int
    spare: int
    every: int


TIERED = ("lru", "lfu")  # the policies a replay with a GPU tier runs (both tiers with the same one)


def run_tiered(
    replay: Replay, policy: str, capacities: Iterable[int], unit: list[int], tier: Tier
) -> dict[int, list[Counters]]:
    """`run_capacities` with a GPU tier in front of each capacity's host cache (the way upload): a hit is
    a key either tier held; `tier_hits` the tier's part. The replay must count uses (`uses=True`): the
    tier's gate counts how many tokens each forward routed to each key, as the engine's does."""
    factories = {"lru": LRUPolicy, "lfu": LFUPolicy}
    if policy not in factories:
        raise ValueError(f"a replay with a GPU tier runs {' or '.join(TIERED)}, not {policy!r}")
    if replay.uses is None:
        raise ValueError("a replay with a GPU tier needs a replay built with uses=True")
    out = {}
    for capacity in sorted(set(capacities)):
        tiers = TieredResidentSet(
            capacity, tier.slots, factories[policy], spare=tier.spare, exclusive=capacity < tier.every
        )
        cells = [Counters() for _ in range(4)]
        for i, forward in enumerate(replay.keys):
            before = tiers.tier_hits
            h, m = tiers.access_group(forward, *replay.uses[i])
            c = cells[replay.cell[i]]
            c.hits += len(h)
            c.tier_hits += tiers.tier_hits - before
            c.misses += len(m)
            c.bytes_read += len(m) * unit[replay.layer[i]]
        out[capacity] = cells
    return out


def run_capacities(
    replay: Replay, policy: str, capacities: Iterable[int], unit: list[int]
) -> dict[int, list[Counters]]:
    """`run_policy` at each of `capacities`: capacity -> Counters per cell (see the module docstring)."""
    capacities = sorted(set(capacities))
    if policy == "lru":
        return {
            capacity: [Counters(h, m, b) for h, m, b in cells]
            for capacity, cells in lru_counts(replay, capacities, unit).items()
        }
    if policy not in ("predictive", "predictive-prefetch"):
        return {capacity: run_policy(replay, policy, capacity, unit) for capacity in capacities}
    out = {}
    for at in range(0, len(capacities), LOCKSTEP):
        chunk = capacities[at : at + LOCKSTEP]
        out.update(zip(chunk, _replay(replay, policy, chunk, unit)))
    return out


def _replay(replay: Replay, policy: str, capacities: list[int], unit: list[int]) -> list[list[Counters]]:
    """One resident set of `policy` per capacity, driven in lockstep over the replay."""
    if policy == "static":
        first = [i for i, c in enumerate(replay.cell) if c < 2]
        second = [i for i, c in enumerate(replay.cell) if c >= 2]
        ranked = rank_by_frequency(replay.keys[i] for i in first)
        return _run([PinnedResidentSet(c, ranked) for c in capacities], replay, unit, second)
    if policy == "partitioned-lru":
        sets = [PartitionedResidentSet(split_evenly(c, replay.layers)) for c in capacities]
        return _run(sets, replay, unit)
    if policy in ("predictive", "predictive-prefetch"):
        if replay.uses is None:
            raise ValueError("the predictive policy needs a replay built with uses=True")
        stats = RoutingStats(replay.layers, replay.n_experts)  # learned once per forward for all of them
        sets = [ResidentSet(c, PredictivePolicy(replay.layers, replay.n_experts, stats)) for c in capacities]
        run = _run_prefetch if policy == "predictive-prefetch" else _run
        return run(sets, replay, unit, uses=replay.uses)
    policies = {
        "lru": LRUPolicy,
        "lfu": LFUPolicy,
        "opt": lambda: BeladyPolicy(replay.keys),
        "lru-prefetch": LRUPolicy,
    }
    if policy not in policies:
        raise ValueError(f"unknown policy {policy!r}")
    sets = [ResidentSet(c, policies[policy]()) for c in capacities]
    return (_run_prefetch if policy == "lru-prefetch" else _run)(sets, replay, unit)


def rank_by_frequency(groups: Iterable[list[Key]]) -> list[Key]:
    """Keys by the number of forwards that used them, most first; ties by first use (deterministic)."""
    counts: Counter[Key] = Counter()
    for keys in groups:
        counts.update(keys)
    return [key for key, _ in counts.most_common()]  # most_common keeps insertion order among ties


def _run(
    sets: Sequence[ResidentSet],
    replay: Replay,
    unit: list[int],
    indices: Iterable[int] | None = None,
    uses: Uses | None = None,
) -> list[list[Counters]]:
    """Every forward (or those at `indices`) through each of `sets`, forward by forward."""
    # plain int lists instead of Counters objects in the hot loop: this loop is the simulator's speed
    hits, misses, nbytes = ([[0] * 4 for _ in sets] for _ in range(3))
    accesses, keys, layer, cell = [s.access_group for s in sets], replay.keys, replay.layer, replay.cell
    for i in range(len(keys)) if indices is None else indices:
        forward, c, args = keys[i], cell[i], () if uses is None else uses[i]
        for n, access in enumerate(accesses):
            h, m = access(forward, *args)
            hits[n][c] += len(h)
            if m:
                misses[n][c] += len(m)
                nbytes[n][c] += len(m) * unit[layer[i]]
    return [[Counters(h[c], m[c], b[c]) for c in range(4)] for h, m, b in zip(hits, misses, nbytes)]


def _run_prefetch(
    sets: Sequence[ResidentSet], replay: Replay, unit: list[int], uses: Uses | None = None
) -> list[list[Counters]]:
    """Each set's policy, and after each forward of layer L, a prefetch of the predicted keys of layer
    L+1 (same step)."""
    if replay.predicted is None:
        raise ValueError("a prefetching policy needs a replay built with predictions")
    out = [[Counters() for _ in range(4)] for _ in sets]
    pending: list[tuple[set[Key], Counters] | None] = [None] * len(sets)
    for i, forward in enumerate(replay.keys):
        args = () if uses is None else uses[i]
        for n, resident in enumerate(sets):
            pending[n] = _step_prefetch(
                resident, forward, args, out[n][replay.cell[i]], pending[n], replay, i, unit
            )
    return out


def _step_prefetch(
    resident: ResidentSet,
    forward: list[Key],
    args: tuple,
    counters: Counters,
    pending: tuple[set[Key], Counters] | None,
    replay: Replay,
    i: int,
    unit: list[int],
) -> tuple[set[Key], Counters] | None:
    """Forward `i` through `resident`, then its prefetch; returns what that prefetch fetched (and for
    whose counters), which the next forward may use."""
    h, m = resident.access_group(forward, *args)
    counters.hits += len(h)
    counters.misses += len(m)
    counters.bytes_read += len(m) * unit[replay.layer[i]]
    if pending is not None:  # the prefetch issued by the previous forward was for this one
        fetched, issuer = pending
        issuer.prefetch_used += sum(1 for key in h if key in fetched)
    guess = replay.predicted[i]
    if not guess:
        return None
    admitted = prefetch(resident, guess)
    size = len(admitted) * unit[replay.layer[i] + 1]
    counters.prefetched += len(admitted)
    counters.prefetch_bytes += size
    counters.bytes_read += size
    return set(admitted), counters

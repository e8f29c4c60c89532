"""Eviction policies against independent brute-force re-implementations and an exhaustive optimum."""

from __future__ import annotations

import random

import pytest

from moestream.cache.partitions import (
    PartitionedLRUPolicy,
    PartitionedResidentSet,
    PinnedResidentSet,
    StaticPolicy,
    split_evenly,
)
from moestream.cache.policy import (
    BeladyPolicy,
    LazyHeap,
    LFUPolicy,
    LRUPolicy,
    ResidentSet,
    prefetch,
    slots_for_budget,
)


def random_groups(seed: int, n_groups: int = 300, n_layers: int = 3, n_experts: int = 6, k: int = 2):
    """Layer forwards cycling over layers, each with k distinct (layer, expert) keys drawn with a skew."""
    rng = random.Random(seed)
    weights = [1.0 / (e + 1) for e in range(n_experts)]
    groups = []
    for i in range(n_groups):
        layer = i % n_layers
        chosen: list[int] = []
        while len(chosen) < k:
            e = rng.choices(range(n_experts), weights)[0]
            if e not in chosen:
                chosen.append(e)
        groups.append([(layer, e) for e in chosen])
    return groups


def brute(groups, capacity: int, victim_of, protect: bool = False) -> int:
    """Reference cache: hits first, then misses in order; `victim_of(candidates, state, i)` picks whom to
    evict. With `protect`, the candidates are the resident keys outside the current group while there are
    any (the engine pins a layer's experts while it computes them)."""
    resident: dict = {}  # key -> (last use tick, use count)
    counts: dict = {}
    tick, misses = 0, 0
    for i, group in enumerate(groups):
        hits = [key for key in group if key in resident]
        for key in hits + [key for key in group if key not in resident]:
            tick += 1
            counts[key] = counts.get(key, 0) + 1
            if key not in resident:
                misses += 1
                if len(resident) == capacity:
                    outside = {k: v for k, v in resident.items() if k not in group}
                    del resident[victim_of(outside if protect and outside else resident, counts, i)]
            resident[key] = tick
    return misses


def lru_victim(resident, counts, i):
    return min(resident, key=lambda key: resident[key])


def lfu_victim(resident, counts, i):
    return min(resident, key=lambda key: (counts[key], resident[key]))


def opt_victim_for(groups):
    def victim(resident, counts, i):
        def next_use(key):
            return next((j for j in range(i + 1, len(groups)) if key in groups[j]), len(groups) + 1)

        return max(resident, key=next_use)

    return victim


def misses_of(resident_set, groups) -> int:
    return sum(len(resident_set.access_group(g)[1]) for g in groups)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", [1, 3, 7])
def test_lru_lfu_opt_match_brute_force(seed: int, capacity: int) -> None:
    groups = random_groups(seed)
    assert misses_of(ResidentSet(capacity, LRUPolicy()), groups) == brute(groups, capacity, lru_victim)
    # LRU never picks a key of the current group while another is resident: protection changes nothing
    assert brute(groups, capacity, lru_victim, protect=True) == brute(groups, capacity, lru_victim)
    assert misses_of(ResidentSet(capacity, LFUPolicy()), groups) == brute(
        groups, capacity, lfu_victim, protect=True
    )
    assert misses_of(ResidentSet(capacity, BeladyPolicy(groups)), groups) == brute(
        groups, capacity, opt_victim_for(groups)
    )


def exhaustive_min_misses(groups, capacity: int) -> int:
    """The fewest misses any eviction choice can reach under the same access protocol (tiny inputs only)."""
    states = {frozenset(): 0}
    for group in groups:
        nxt: dict[frozenset, int] = {}
        for state, cost in states.items():
            misses = [k for k in group if k not in state]
            frontier = {state}
            for key in misses:  # admit in order; when full, any resident may be the victim
                grown = set()
                for s in frontier:
                    if len(s) < capacity:
                        grown.add(s | {key})
                    else:
                        grown.update((s - {v}) | {key} for v in s)
                frontier = grown
            for s in frontier:
                nxt[s] = min(nxt.get(s, 1 << 30), cost + len(misses))
        states = nxt
    return min(states.values())


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_optimal_on_tiny_traces(seed: int) -> None:
    groups = random_groups(seed, n_groups=14, n_layers=2, n_experts=4, k=2)
    for capacity in (2, 3):
        assert misses_of(ResidentSet(capacity, BeladyPolicy(groups)), groups) == exhaustive_min_misses(
            groups, capacity
        )


@pytest.mark.parametrize("seed", range(5))
def test_belady_never_loses(seed: int) -> None:
    groups = random_groups(seed, n_groups=400, n_layers=4, n_experts=8, k=3)
    for capacity in (4, 8, 16):
        best = misses_of(ResidentSet(capacity, BeladyPolicy(groups)), groups)
        for other in (
            ResidentSet(capacity, LRUPolicy()),
            ResidentSet(capacity, LFUPolicy()),
            PartitionedResidentSet(split_evenly(capacity, range(4))),
            PinnedResidentSet(capacity, sorted({k for g in groups for k in g})),
        ):
            assert best <= misses_of(other, groups)


def test_belady_rejects_keys_outside_its_future() -> None:
    rs = ResidentSet(2, BeladyPolicy([[(0, 1)]]))
    rs.access_group([(0, 1)])
    with pytest.raises(ValueError, match="future"):
        rs.access_group([(0, 1)])


def test_partitioned_lru_matches_per_layer_brute_force() -> None:
    groups = random_groups(7, n_groups=300, n_layers=3, n_experts=6, k=2)
    quotas = split_evenly(7, [0, 1, 2])
    assert quotas == {0: 3, 1: 2, 2: 2}
    expected = sum(
        brute([g for g in groups if g[0][0] == layer], quotas[layer], lru_victim) for layer in quotas
    )
    assert misses_of(PartitionedResidentSet(quotas), groups) == expected


def test_partition_with_zero_quota_streams_that_layer() -> None:
    rs = PartitionedResidentSet({0: 1, 1: 0})
    assert rs.access_group([(1, 0)]) == ([], [(1, 0)])
    assert rs.access_group([(1, 0)]) == ([], [(1, 0)])  # never kept
    assert rs.access_group([(0, 0)]) == ([], [(0, 0)])
    assert rs.access_group([(0, 0)]) == ([(0, 0)], [])


def test_partitioned_policy_fallback_victim_is_fullest_layers_lru() -> None:
    rs = ResidentSet(3, PartitionedLRUPolicy())
    rs.access_group([(0, 1), (1, 1), (1, 2)])
    rs.access_group(
        [(0, 2)]
    )  # full: the plain ResidentSet asks victim(): layer 1 has 2 keys, its LRU is (1, 1)
    assert (1, 1) not in rs and (0, 1) in rs


def test_pinned_set_keeps_pins_and_streams_the_rest() -> None:
    rs = PinnedResidentSet(2, [(0, 5), (0, 6), (0, 7)])
    assert (0, 5) in rs and (0, 6) in rs and (0, 7) not in rs
    assert rs.access_group([(0, 7), (0, 5)]) == ([(0, 5)], [(0, 7)])
    assert rs.access_group([(0, 7)]) == ([], [(0, 7)])  # every slot pinned: read and dropped
    assert len(rs) == 2


def test_pinned_set_uses_leftover_slots_as_lru() -> None:
    rs = PinnedResidentSet(3, [(0, 1)])
    assert rs.streaming_slots == 2
    for group in ([(0, 2)], [(0, 3)], [(0, 4)]):
        rs.access_group(group)
    assert (0, 1) in rs and (0, 2) not in rs and (0, 3) in rs and (0, 4) in rs


def test_static_policy_refuses_when_everything_is_pinned() -> None:
    rs = ResidentSet(1, StaticPolicy([(0, 0)]))
    rs.admit((0, 0))
    with pytest.raises(LookupError, match="pinned"):
        rs.admit((0, 1))


def test_prefetch_admits_only_missing_keys_without_refreshing_residents() -> None:
    rs = ResidentSet(2, LRUPolicy())
    rs.access_group([(0, 1), (0, 2)])
    assert prefetch(rs, [(0, 1), (0, 3)]) == [(0, 3)]
    # (0, 1) was not touched by the prefetch, so it was the LRU key and made room for (0, 3)
    assert (0, 1) not in rs and (0, 2) in rs and (0, 3) in rs


def test_lazy_heap_walks_live_keys_in_priority_order() -> None:
    """Against a dict: key -> (priority, when it was ranked); equal priorities go to the earlier ranked."""
    rng = random.Random(5)
    heap, truth = LazyHeap(), {}
    for step in range(3000):
        key = rng.randrange(60)
        if key in truth and rng.random() < 0.3:
            heap.discard(key)
            del truth[key]
        else:
            priority = rng.randrange(20)
            heap.rank(key, priority)
            truth[key] = (priority, step)
        if step % 97 == 0 and truth:
            expected = sorted(truth, key=lambda k: truth[k])
            assert list(heap.ordered()) == expected
            assert heap.first() == expected[0] and len(heap) == len(truth)


def test_slots_for_budget() -> None:
    assert slots_for_budget(10 * 1024, 1024) == 10
    assert slots_for_budget(10 * 1024 + 1023, 1024) == 10  # whole slots only
    assert slots_for_budget(100, 1024) == 0  # the caller decides whether that is an error
    assert slots_for_budget(100, 1024, floor=4) == 4
    assert slots_for_budget(1 << 50, 1024, limit=512) == 512
    with pytest.raises(ValueError, match="at least one byte"):
        slots_for_budget(1024, 0)


def test_a_huge_capacity_costs_no_memory() -> None:
    """Slots are handed out lazily: a resident set of 10^15 slots holds only what was admitted."""
    import tracemalloc

    tracemalloc.start()
    rs = ResidentSet(10**15, LRUPolicy())
    for group in random_groups(3, n_groups=200):
        rs.access_group(group)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20
    assert len(rs) == len({k for g in random_groups(3, n_groups=200) for k in g})
    assert sorted(rs._slot_of.values()) == list(range(len(rs)))  # slots 0.. in order, no gaps


def test_freed_slots_are_reused_last_freed_first() -> None:
    rs = ResidentSet(4, LRUPolicy())
    for key in range(4):
        assert rs.admit((0, key)) == (key, None)
    rs.remove((0, 1))
    rs.remove((0, 3))
    assert rs.admit((0, 9)) == (3, None) and rs.admit((0, 8)) == (1, None)
    assert rs.admit((0, 7)) == (0, (0, 0))  # full again: the LRU key's slot

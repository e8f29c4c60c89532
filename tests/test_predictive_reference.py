"""The predictive policy decides exactly as it did before it was made fast (`predictive_reference`, the
old code kept verbatim): the same hits, misses, victims and slots at every step, alone as the engine
runs it and in the simulator's lockstep of many capacities sharing one `RoutingStats`."""

from __future__ import annotations

import pytest
from predictive_reference import ReferencePredictivePolicy
from shared_data import MIXTRAL, needs_traces
from test_predictive_policy import forwards

from moestream.cache.policy import ResidentSet, prefetch
from moestream.cache.predictive import PredictivePolicy, RoutingStats
from moestream.trace.policy_replay import run_capacities
from moestream.trace.reader import load_traces
from moestream.trace.replay import Replay, build_replay
from moestream.trace.synthetic import random_trace


def replay_of(seed: int) -> Replay:
    """Prefills of 4-7 tokens (forwards of many keys, counted uses), decode, stale-gate predictions."""
    trace = random_trace(
        n_layers=4,
        n_experts=10,
        top_k=3,
        n_requests=3,
        prompt_len=4 + seed,
        decode_len=40,
        seed=seed,
        predictions=True,
    )
    return build_replay(trace, prefetch_top=3, uses=True)


def lockstep_pair(capacity: int, layers: list[int], n_experts: int) -> tuple[ResidentSet, ResidentSet]:
    return (
        ResidentSet(capacity, ReferencePredictivePolicy(layers, n_experts)),
        ResidentSet(capacity, PredictivePolicy(layers, n_experts)),
    )


def assert_same_step(old: ResidentSet, new: ResidentSet, keys: list, uses: list | None, tokens: int, guess):
    """One forward, then a prefetch of `guess` (evictions outside any forward), in both; compare all."""
    assert new.access_group(keys, uses, tokens) == old.access_group(keys, uses, tokens)
    assert new.policy.leader == old.policy.leader
    if guess:
        assert prefetch(new, guess) == prefetch(old, guess)
    assert new._slot_of == old._slot_of  # the same victims, in the same order (freed slots are reused)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("capacity", [1, 2, 5, 9, 16, 40])
def test_alone_it_decides_as_before(seed: int, capacity: int) -> None:
    """As the engine runs it: one policy, its own stats; capacities below a prefill's keys and above the
    trace's, with prefetches that evict between forwards."""
    replay = replay_of(seed)
    old, new = lockstep_pair(capacity, replay.layers, replay.n_experts)
    for i, keys in enumerate(replay.keys):
        assert_same_step(old, new, keys, *replay.uses[i], replay.predicted[i])


def test_under_every_leader_it_decides_as_before() -> None:
    """Drifting, sticky routing (the policy tests' workload) puts each ranking in the lead in turn."""
    leaders = set()
    layers, n_experts = [0, 2, 5], 6
    for seed in range(3):
        for capacity in (6, 9, 14):
            old, new = lockstep_pair(capacity, layers, n_experts)
            for keys, uses, tokens in forwards(seed, layers, n_experts, k=2):
                nxt = layers[layers.index(keys[0][0]) + 1] if keys[0][0] != layers[-1] else None
                guess = [(nxt, (keys[0][1] + e) % n_experts) for e in (1, 3)] if nxt is not None else None
                assert_same_step(old, new, keys, uses, tokens, guess)
                leaders.add(new.policy.leader)
    assert leaders == {0, 1, 2}


def old_counts(replay: Replay, capacity: int, prefetching: bool) -> list[tuple[int, int, int]]:
    """(hits, misses, prefetched) per cell with the old class, one capacity at a time."""
    cache = ResidentSet(capacity, ReferencePredictivePolicy(replay.layers, replay.n_experts))
    out = [[0, 0, 0] for _ in range(4)]
    for i, keys in enumerate(replay.keys):
        hits, misses = cache.access_group(keys, *replay.uses[i])
        cell = out[replay.cell[i]]
        cell[0] += len(hits)
        cell[1] += len(misses)
        if prefetching and replay.predicted[i]:
            cell[2] += len(prefetch(cache, replay.predicted[i]))
    return [tuple(cell) for cell in out]


@pytest.mark.parametrize("policy", ["predictive", "predictive-prefetch"])
def test_the_simulators_lockstep_counts_as_before(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capacities replayed together, sharing what is learned (in lockstep batches of 4 here, so that a
    batch boundary is crossed), count what one old policy per capacity counted."""
    monkeypatch.setattr("moestream.trace.policy_replay.LOCKSTEP", 4)
    replay = replay_of(1)
    capacities = [1, 3, 4, 6, 8, 11, 15, 20, 27, 41]
    counts = run_capacities(replay, policy, capacities, [1] * 4)
    for capacity in capacities:
        mine = [(c.hits, c.misses, c.prefetched) for c in counts[capacity]]
        assert mine == old_counts(replay, capacity, policy == "predictive-prefetch"), capacity


@needs_traces
def test_on_a_real_trace_it_counts_as_before() -> None:
    replay = build_replay(load_traces([MIXTRAL]), uses=True)
    capacities = [40, 64, 100, 160]
    counts = run_capacities(replay, "predictive", capacities, [1] * 32)
    for capacity in capacities:
        mine = [(c.hits, c.misses, 0) for c in counts[capacity]]
        assert mine == old_counts(replay, capacity, False), capacity


def test_policies_sharing_stats_must_see_the_same_forwards() -> None:
    stats = RoutingStats([0, 1], 4)
    a = ResidentSet(2, PredictivePolicy([0, 1], 4, stats))
    b = ResidentSet(3, PredictivePolicy([0, 1], 4, stats))
    a.access_group([(0, 1), (0, 2)])
    b.access_group([(0, 1), (0, 2)])  # the same forward as another list: checked, not learned twice
    assert stats.forward == 1 and stats.uses[1] == 1
    b.access_group([(1, 3)])  # b runs ahead of a: it teaches forward 2
    with pytest.raises(RuntimeError, match="same forwards in order"):
        a.access_group([(1, 0)])  # a's forward 2 is another one
    with pytest.raises(ValueError, match="other layers"):
        PredictivePolicy([0, 1, 2], 4, stats)


@pytest.mark.parametrize("leader", [1, 2])  # LFU, LRU
def test_ties_among_prefetched_keys_never_used_go_as_before(
    leader: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys prefetched and never used share use count 0 and touch 0: the old ranking took the lowest
    index first."""
    import predictive_reference

    import moestream.cache.predictive as P

    for module in (P, predictive_reference):
        monkeypatch.setattr(module, "DUEL_MARGIN", 1.0)  # the leader set below stays
    old, new = lockstep_pair(4, [0, 1], 8)
    old.policy.leader = new.policy.leader = leader
    guess = [(1, 5), (1, 2), (1, 7), (1, 0)]
    assert prefetch(new, guess) == prefetch(old, guess) == guess
    for keys in ([(0, 1)], [(0, 3), (0, 4)], [(1, 6)]):
        assert_same_step(old, new, keys, None, 1, None)
    assert (1, 0) not in new._slot_of

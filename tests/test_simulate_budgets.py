"""Many budgets at once: LRU in one pass and budgets past a policy's working set reported from one replay,
each checked against the per-budget replay through the engine's own classes (`run_policy`)."""

from __future__ import annotations

import random

import pytest
from shared_data import MIXTRAL, QWEN, needs_traces

from moestream.trace import policy_replay
from moestream.trace.lru_stack import lru_counts
from moestream.trace.reader import load_traces
from moestream.trace.replay import Replay, build_replay
from moestream.trace.simulator import POLICIES, capacity_for, run_policy, saturation, simulate
from moestream.trace.synthetic import random_trace
from moestream.trace.table import Trace
from moestream.units import MiB


def per_budget(replay: Replay, capacity: int, unit: list[int]) -> list[tuple[int, int, int]]:
    """The oracle: one LRU replay through `ResidentSet` + `LRUPolicy`, as (hits, misses, bytes) per cell."""
    return [(c.hits, c.misses, c.bytes_read) for c in run_policy(replay, "lru", capacity, unit)]


def working_set(replay: Replay) -> int:
    return len({key for keys in replay.keys for key in keys})


def synthetic(seed: int, **kw) -> Trace:
    shape = {"n_layers": 3, "n_experts": 12, "top_k": 3, "n_requests": 3, "prompt_len": 5, "decode_len": 15}
    return random_trace(**{**shape, **kw}, seed=seed, predictions=True)


@pytest.mark.parametrize("seed", range(6))
def test_lru_one_pass_equals_every_per_budget_replay(seed: int) -> None:
    """Every capacity from 1 to past the working set, and a sparse random subset (whose hit sets are
    stored over fewer capacities), on traces whose prefills give forwards of many keys."""
    replay = build_replay(synthetic(seed, prompt_len=4 + seed))
    unit = [1000 + 7 * layer for layer in range(3)]  # per-layer sizes: bytes must follow the layer
    every = range(1, working_set(replay) + 3)
    sparse = sorted(random.Random(seed).sample(every, 9))
    for capacities in (every, sparse):
        counts = lru_counts(replay, capacities, unit)
        assert sorted(counts) == sorted(capacities)
        for capacity in capacities:
            assert counts[capacity] == per_budget(replay, capacity, unit), capacity


def test_lru_is_not_a_textbook_stack_algorithm_and_the_one_pass_knows() -> None:
    """A forward touches its hits before its misses, so the order inside it depends on the capacity, and
    more slots can mean fewer hits. Here (worked out by hand) the last access, the only decode one, hits
    with 3 slots and misses with 4: [k] [x] [b] [a] leave k resident only at 4; the forward [k, a, b]
    then puts k last of the three at 3 (a miss, touched after a and b's hits) but first at 4; after [y]
    and [z], k is the newest of the 3 resident keys at 3, and the one [z] evicted at 4."""
    k, x, a, b, y, z = ((0, e) for e in range(6))
    keys = [[k], [x], [b], [a], [k, a, b], [y], [z], [k]]
    replay = Replay(keys, [0] * 8, [0] * 7 + [1], None, [7, 1, 0, 0], "", [0], 6)
    counts = lru_counts(replay, [3, 4], [1])
    assert counts[3] == per_budget(replay, 3, [1]) and counts[4] == per_budget(replay, 4, [1])
    decode_hits = {capacity: counts[capacity][1][0] for capacity in (3, 4)}
    assert decode_hits == {3: 1, 4: 0}


@needs_traces
@pytest.mark.parametrize("name", ["mixtral", "qwen"])
def test_lru_one_pass_on_real_traces(name: str) -> None:
    trace = load_traces([MIXTRAL] if name == "mixtral" else QWEN)
    replay = build_replay(trace)
    unit = [4096] * trace.header.n_layers
    capacities = sorted(random.Random(1).sample(range(1, working_set(replay) + 3), 40))
    counts = lru_counts(replay, capacities, unit)
    for capacity in capacities:
        assert counts[capacity] == per_budget(replay, capacity, unit), capacity


def test_budgets_past_the_working_set_change_nothing() -> None:
    """The proof that the simulator may skip them: through the engine's classes, every policy gives at
    its saturation capacity exactly what it gives at any larger one."""
    replay = build_replay(synthetic(0, n_requests=4), prefetch_top=3, uses=True)
    unit = [MiB] * 3
    limits = {policy: saturation(replay, policy) for policy in POLICIES}
    routed = working_set(replay)
    assert limits["lru"] == limits["opt"] == limits["static"] == routed
    assert limits["partitioned-lru"] >= routed and limits["lru-prefetch"] >= routed
    for policy, limit in limits.items():
        at_limit = run_policy(replay, policy, limit, unit)
        for capacity in (limit + 1, 2 * limit + 5, 1 << 20):
            assert run_policy(replay, policy, capacity, unit) == at_limit, (policy, capacity)
    # the limit is the least such capacity where it can be seen: one slot fewer evicts a key used again
    assert run_policy(replay, "lru", routed - 1, unit) != run_policy(replay, "lru", routed, unit)


def old_simulate(trace: Trace, policies: list[str], budgets: list[int]) -> dict[tuple[str, int], list]:
    """The per-budget path the simulator had: every (budget, policy) replayed through `run_policy`."""
    replay = build_replay(trace, trace.header.top_k, uses=True)
    unit = list(trace.header.expert_bytes)
    return {
        (policy, budget): run_policy(replay, policy, capacity_for(budget, MiB), unit)
        for budget in budgets
        for policy in policies
    }


def test_simulate_equals_the_per_budget_path_and_replays_each_capacity_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = synthetic(2)
    routed = working_set(build_replay(trace))
    # slots of 1 MiB: repeats of one capacity, capacities below, at and past every saturation
    budgets = [MiB * n for n in (1, 2, 5, 5, 9, routed - 1, routed, routed + 3, 4 * routed, 1 << 16)]
    budgets += [budgets[2] + 1000]  # a budget that buys the same 5 slots
    expected = old_simulate(trace, list(POLICIES), sorted(set(budgets)))
    calls = []  # (policy, capacity) of every resident set the simulator drives
    real_replay = policy_replay._replay

    def spy(replay: Replay, policy: str, capacities: list[int], unit: list[int]) -> list:
        calls.extend((policy, capacity) for capacity in capacities)
        return real_replay(replay, policy, capacities, unit)

    monkeypatch.setattr(policy_replay, "_replay", spy)
    records, replay, sizes = simulate(trace, list(POLICIES), budgets)
    for r in records:
        cells = expected[(r["policy"], r["budget_bytes"])]
        phase = 1 if r["phase"] == "decode" else 0
        mine = [cells[2 + phase]] + ([cells[phase]] if r["scope"] == "all" else [])
        assert (r["hits"], r["misses"], r["bytes_read"], r["prefetched"], r["prefetch_used"]) == (
            sum(c.hits for c in mine),
            sum(c.misses for c in mine),
            sum(c.bytes_read for c in mine),
            sum(c.prefetched for c in mine),
            sum(c.prefetch_used for c in mine),
        ), r
    assert not [c for c in calls if c[0] == "lru"]  # LRU: one pass, no per-budget replay
    assert len(calls) == len(set(calls))  # a capacity twice in the budgets is replayed once
    for policy in POLICIES:
        if policy != "lru":
            limit = saturation(replay, policy)
            assert max(c for p, c in calls if p == policy) == limit, policy  # nothing past it replayed
    assert any("reported without a replay" in note for note in sizes.notes)


def test_no_note_when_no_budget_reaches_the_working_set() -> None:
    _, _, sizes = simulate(synthetic(3), ["lru", "lfu"], [4 * MiB, 8 * MiB])
    assert not any("without a replay" in note for note in sizes.notes)

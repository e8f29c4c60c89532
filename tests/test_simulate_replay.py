"""The simulator: hand-computed counts on a tiny trace, an independent brute-force LRU on random traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from moestream.errors import CacheBudgetError
from moestream.trace import TraceError, TraceHeader, TraceWriter, read_trace
from moestream.trace.simulator import POLICIES, simulate
from moestream.trace.synthetic import random_trace
from moestream.units import MiB


def tiny(tmp_path: Path, **header_kw) -> Path:
    """2 layers x 4 experts, top-2: a 2-token prefill then one decode token (see the hand counts below)."""
    h = TraceHeader("tiny", 2, 4, 2, expert_bytes=MiB, **header_kw)
    path = tmp_path / "tiny.parquet"
    with TraceWriter(path, h) as w:
        w.append_forward(
            "r",
            [0, 1],
            "prefill",
            0,
            [[0, 1], [1, 2]],
            [[0.5, 0.5]] * 2,
            pred_experts=[[3, 0, 2, 1], [0, 1, 2, 3]],
            pred_scores=[[4, 3, 2, 1]] * 2,
        )
        w.append_forward("r", [0, 1], "prefill", 1, [[3, 0], [0, 3]], [[0.5, 0.5]] * 2)
        w.append("r", 2, "decode", 0, [0, 1], [0.5, 0.5], pred_experts=[3, 2, 1, 0], pred_scores=[4, 3, 2, 1])
        w.append("r", 2, "decode", 1, [3, 0], [0.5, 0.5])
    return path


def by(records, policy, phase, scope="all"):
    return next(r for r in records if r["policy"] == policy and r["phase"] == phase and r["scope"] == scope)


# Capacity 3. Forwards: F1 prefill L0 {00,01,02}, F2 prefill L1 {13,10}, F3 decode L0 {00,01}, F4 decode L1
# {13,10}.
EXPECTED = {  # policy: (prefill hits, misses), (decode hits, misses)   -- worked out by hand
    "lru": ((0, 5), (1, 3)),
    "lfu": ((0, 5), (1, 3)),
    "partitioned-lru": ((0, 5), (2, 2)),  # quotas L0: 2, L1: 1; F1 leaves 01, 02 in L0, so F3 hits 01
    "opt": ((0, 5), (3, 1)),  # F2 evicts 02 (never used again) and 13 (used last)
}


def test_hand_computed_counts(tmp_path: Path) -> None:
    records, replay, _ = simulate(read_trace(tiny(tmp_path)), list(POLICIES), [3 * MiB])
    assert replay.tokens == [2, 0, 0, 1]  # prefill is the first half, decode the second (split by steps)
    for policy, ((ph, pm), (dh, dm)) in EXPECTED.items():
        pre, dec = by(records, policy, "prefill"), by(records, policy, "decode")
        assert (pre["hits"], pre["misses"], dec["hits"], dec["misses"]) == (ph, pm, dh, dm), policy
        assert pre["mib_per_token"] == pm / 2 and dec["mib_per_token"] == dm / 1
        assert dec["hit_rate"] == dh / (dh + dm)
    # static: pins the first three keys of the first half (00, 01, 02: all used once, first seen first)
    static = by(records, "static", "decode", "second-half")
    assert (static["hits"], static["misses"], static["tokens"]) == (2, 2, 1)
    assert not [r for r in records if r["policy"] == "static" and r["scope"] == "all"]


def test_hand_computed_prefetch(tmp_path: Path) -> None:
    records, _, _ = simulate(read_trace(tiny(tmp_path)), ["lru-prefetch"], [3 * MiB])
    pre, dec = by(records, "lru-prefetch", "prefill"), by(records, "lru-prefetch", "decode")
    # F1 prefetches 13, 10, 11 (the union of both tokens' top-2); F2 then hits 13 and 10
    assert (pre["hits"], pre["misses"], pre["prefetched"], pre["prefetch_used"]) == (2, 3, 3, 2)
    assert (pre["mib_per_token"], pre["wait_mib_per_token"], pre["prefetch_mib_per_token"]) == (3.0, 1.5, 1.5)
    # F3 misses 00, 01, prefetches 13, 12; F4 hits 13, misses 10
    assert (dec["hits"], dec["misses"], dec["prefetched"], dec["prefetch_used"]) == (1, 3, 2, 1)
    assert (dec["mib_per_token"], dec["wait_mib_per_token"], dec["prefetch_used_fraction"]) == (5.0, 3.0, 0.5)


def test_slot_bytes_set_the_capacity_and_unit_bytes_the_reads(tmp_path: Path) -> None:
    trace = read_trace(tiny(tmp_path, slot_bytes=2 * MiB))
    records, _, sizes = simulate(trace, ["lru"], [6 * MiB])
    assert sizes.slot_bytes == 2 * MiB and by(records, "lru", "decode")["capacity_slots"] == 3
    assert by(records, "lru", "prefill")["bytes_read"] == 5 * MiB
    records, _, _ = simulate(trace, ["lru"], [6 * MiB], unit_bytes=10 * MiB)
    assert by(records, "lru", "prefill")["bytes_read"] == 50 * MiB


def test_user_errors(tmp_path: Path) -> None:
    trace = read_trace(tiny(tmp_path))
    with pytest.raises(CacheBudgetError, match="holds no expert slot"):
        simulate(trace, ["lru"], [MiB // 2])
    trace.header.expert_bytes = None
    with pytest.raises(TraceError, match="--unit-bytes"):
        simulate(trace, ["lru"], [MiB])
    no_pred = random_trace(n_requests=1, predictions=False)
    with pytest.raises(TraceError, match="no stale-gate predictions"):
        simulate(no_pred, ["lru-prefetch"], [8 * MiB])


def brute_force_lru(trace, capacity: int) -> dict[str, int]:
    """Independent replay: forwards by (step, layer) in row order, distinct experts in first-seen order;
    a list ordered by recency stands for the cache."""
    forwards: dict[tuple[int, int], list[int]] = {}
    for i in sorted(range(len(trace)), key=lambda i: (trace.step[i], trace.layer[i], i)):
        forwards.setdefault((int(trace.step[i]), int(trace.layer[i])), []).append(i)
    cache: list[tuple[int, int]] = []
    misses = {"prefill": 0, "decode": 0}
    for (_, layer), rows in forwards.items():
        keys: list[tuple[int, int]] = []
        for i in rows:
            keys += [(layer, int(e)) for e in trace.experts[i] if (layer, int(e)) not in keys]
        present = [k for k in keys if k in cache]
        for k in present:
            cache.remove(k)
            cache.append(k)
        for k in keys:
            if k not in present:
                misses["decode" if trace.phase[rows[0]] else "prefill"] += 1
                if len(cache) == capacity:
                    cache.pop(0)
                cache.append(k)
    return misses


@pytest.mark.parametrize("seed", range(3))
def test_lru_matches_brute_force_and_opt_bounds_everything(seed: int) -> None:
    trace = random_trace(
        n_layers=4,
        n_experts=16,
        top_k=3,
        n_requests=3,
        prompt_len=6,
        decode_len=20,
        seed=seed,
        predictions=True,
    )
    budgets = [8 * MiB, 20 * MiB, 40 * MiB]
    records, _, _ = simulate(trace, list(POLICIES), budgets)
    for budget in budgets:
        expected = brute_force_lru(trace, budget // MiB)
        for phase in ("prefill", "decode"):
            assert (
                by([r for r in records if r["budget_bytes"] == budget], "lru", phase)["misses"]
                == expected[phase]
            )
        # Belady minimises the total over the whole trace (not each phase): no demand policy misses less,
        # and a prefetching one cannot read less either (its prefetches are reads too)
        rows = [r for r in records if r["budget_bytes"] == budget and r["scope"] == "all"]
        total = {p: sum(r["misses"] + r["prefetched"] for r in rows if r["policy"] == p) for p in POLICIES}
        del total["static"]  # evaluated on the second half only, with its pins loaded for free
        assert all(total["opt"] <= t for t in total.values()), (budget, total)


def test_request_split_for_static(tmp_path: Path) -> None:
    trace = random_trace(n_layers=2, n_experts=8, top_k=2, n_requests=4, prompt_len=3, decode_len=5)
    records, replay, _ = simulate(trace, ["static", "lru"], [4 * MiB])
    assert replay.split.startswith("requests 1-2 / 3-4")
    assert replay.tokens == [6, 10, 6, 10]
    assert by(records, "static", "decode", "second-half")["tokens"] == 10


def test_a_budget_far_above_the_trace_costs_no_memory_and_changes_nothing() -> None:
    """1 TiB of 1 MiB slots is a million slots: replayed in bounded memory, with the same counts as a
    budget that just holds every key of the trace."""
    import tracemalloc

    trace = random_trace(n_layers=4, n_experts=16, top_k=3, n_requests=2, decode_len=10, predictions=True)
    policies = [p for p in POLICIES if p != "static"]
    enough, _, _ = simulate(trace, policies, [64 * MiB])  # 4 x 16 keys of 1 MiB
    tracemalloc.start()
    huge, _, _ = simulate(trace, policies, [1 << 40])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 32 << 20
    counts = [(r["policy"], r["phase"], r["scope"], r["hits"], r["misses"]) for r in enough]
    assert counts == [(r["policy"], r["phase"], r["scope"], r["hits"], r["misses"]) for r in huge]
    assert {r["capacity_slots"] for r in huge} == {1 << 20}

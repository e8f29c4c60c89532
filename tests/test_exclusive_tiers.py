"""Exclusive tiers: a GPU tier over a host cache that does not hold every expert (`--gpu-tier` with a
bounded `--cache`). An expert copied into the tier is the host cache's next victim (`ResidentSet.demote`),
one the tier evicts is kept by the host cache as used now, and a miss the tier's gate keeps out passes
through a spare device slot (`GpuTier.lend`) instead of evicting a resident as likely to be used. The
policy's part is plain Python (checked against uniform routing's oracle: a tier's hit rate is the share
of the experts it holds, so tiers that add up read 1 - (a + b) / n of a token's experts from disk); the
engine's against its own bookkeeping and the in-place CPU graphs' bits.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_gpu_tier import GREEDY, PROMPT, _run, _sizes

import moestream
from moestream.cache.policy import LRUPolicy, ResidentSet
from moestream.cache.size_classes import budget_requirements
from moestream.cache.tiers import TieredResidentSet


def _full(n: int) -> ResidentSet:
    rs = ResidentSet(n, LRUPolicy())
    for k in range(n):
        rs.admit(k)
    return rs


def test_a_demoted_key_is_the_next_victim_the_latest_first_until_touched_or_removed():
    rs = _full(4)  # LRU order 0, 1, 2, 3
    assert rs.next_victim() == 0
    rs.demote(2)
    rs.demote(3)
    assert rs.next_victim() == 3  # the latest demoted first: the tier above keeps it longest
    assert rs.next_victim(protected={3}) == 2
    assert rs.next_victim(protected={2, 3}) == 0  # then the policy's own order
    rs.touch(3)  # used here again: an ordinary key
    assert rs.next_victim() == 2
    _, evicted = rs.admit(9)
    assert evicted == 2 and 2 not in rs
    assert rs.next_victim() == 0  # nothing demoted is left
    rs.demote(99)  # not resident: nothing to do
    assert rs.next_victim() == 0


def test_the_admissions_evictions_are_logged_where_asked():
    rs = _full(2)
    rs.admit(5)
    assert rs.evicted is None
    rs.evicted = []
    rs.access_group([7, 5])
    assert rs.evicted == [1]  # 0 went for 5 before the log; 1 for 7 (5 is the group's own)


def _two_tiers(a: int, b: int, n: int, k: int, steps: int, exclusive: bool, seed: int = 0) -> float:
    """The share of routed experts read from disk under uniform routing through `TieredResidentSet` (the
    simulator's replay of the engine's decisions): a tier of `a` slots (`k` lent) over a host cache of
    `b`, exclusive or not (every miss admitted, the engine before the tiers were exclusive), counted after
    a warm-up."""
    rng = random.Random(seed)
    tiers = TieredResidentSet(b, a, LRUPolicy, spare=k, exclusive=exclusive)
    read = routed = 0
    for step in range(steps):
        _, from_disk = tiers.access_group([(0, e) for e in rng.sample(range(n), k)])
        if step >= steps // 4:
            read, routed = read + len(from_disk), routed + k
    return read / routed


def test_under_uniform_routing_exclusive_tiers_add_up_and_inclusive_ones_do_not():
    a, b, n, k = 150, 370, 600, 8  # the H100's 2 GiB tier over a 5 GiB cache of 8.2 GiB, scaled down
    exclusive = _two_tiers(a, b, n, k, 6000, True)
    inclusive = _two_tiers(a, b, n, k, 6000, False)
    assert exclusive == pytest.approx(1 - (a + b - k) / n, abs=0.02)  # 0.147: both tiers' experts
    assert inclusive == pytest.approx(1 - b / n, abs=0.02)  # 0.383: the host cache's alone


def test_simulate_with_a_gpu_tier_reads_what_neither_tier_holds():
    """`simulate --gpu-tier` on a uniformly routed trace: the tier's hit rate its share of the experts, the
    two tiers' together theirs (exclusive: the host cache cannot hold every expert), and a host cache
    holding every expert reads nothing after the first use of each."""
    from moestream.trace.simulator import simulate
    from moestream.trace.synthetic import random_trace

    n, k = 4 * 64, 4
    trace = random_trace(4, 64, k, n_requests=8, prompt_len=4, decode_len=300, skew=0.0, stickiness=0.0)
    budgets = [96 << 20, 256 << 20]  # 96 of 256 experts; all of them
    records, _, _ = simulate(trace, ["lru"], budgets, gpu_tier=64 << 20)
    decode = {r["budget_bytes"]: r for r in records if r["phase"] == "decode" and r["scope"] == "all"}
    small = decode[96 << 20]
    assert small["gpu_tier_bytes"] == 64 << 20
    assert small["gpu_tier_hit_rate"] == pytest.approx((64 - k) / n, abs=0.03)  # 0.234 (4 slots lent)
    assert small["hit_rate"] == pytest.approx((96 + 64 - k) / n, abs=0.03)  # 0.609: both tiers'
    every = decode[256 << 20]
    assert every["misses"] <= n  # each expert read once at most
    with pytest.raises(Exception, match="--gpu-tier replays lru or lfu"):
        simulate(trace, ["opt"], budgets, gpu_tier=64 << 20)
    with pytest.raises(Exception, match="fewer than the 4 a token routes to"):
        simulate(trace, ["lru"], budgets, gpu_tier=3 << 20)


def _host_caches(path) -> tuple[int, int]:
    """(a host cache of about half the experts, one of all but a few: the tier's residents stay in it)."""
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        small, _ = budget_requirements(engine.emap, engine.top_k)
        every = engine.cache.allocated_bytes
        return (small + every) // 2, every - 3 * engine.cache.slot_bytes


@pytest.mark.parametrize("misses", ["upload", "auto", "host"])
@pytest.mark.parametrize("most", [False, True])
def test_the_engines_tiers_are_exclusive_and_give_the_in_place_bits(most, misses, tiny_dir, monkeypatch):
    path = tiny_dir("qwen3_moe")
    want, want_tokens, _ = _run(path, monkeypatch, "")  # the CPU graphs, every expert cached
    _, _, every, _ = _sizes(path, monkeypatch)
    host = _host_caches(path)[most]
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
    with moestream.load(str(path), cache=host, trunk="ggml", gpu_tier=every // 2) as engine:
        from test_ggml_runner import _runner_logits

        steps = engine.runner.tiered
        assert "the host cache evicts first what the tier holds" in engine.mode_line()
        got = _runner_logits(engine, PROMPT)
        gen = engine.generate(PROMPT, max_tokens=4 * GREEDY, ignore_eos=True)
        assert torch.equal(got, want)
        assert gen.tokens[:GREEDY] == want_tokens
        tier, _ = steps.tier()
        if misses != "host":  # (there the CPU computes the misses the gate keeps out)
            assert tier.counters.lent > 0  # misses the gate kept out passed through spare slots
        cache = engine.cache
        in_tier = [(layer, e) for c in tier._classes for (layer, e) in c.residents._slot_of]
        in_host = cache.resident_keys()
        assert in_tier
        both = [key for key in in_tier if key in in_host]
        for key in both:  # what the tier holds, the host cache evicts first (or holds no longer)
            assert key in cache.state_of(key).cls.residents._demoted, key
        if most:  # all but a few experts in the host cache: the tier's mostly still there, demoted
            assert len(both) >= len(in_tier) // 2


def test_a_host_cache_holding_every_expert_keeps_the_tier_inclusive(tiny_dir, monkeypatch):
    path = tiny_dir("qwen3_moe")
    _, middle, _, _ = _sizes(path, monkeypatch)
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", "upload")
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=middle) as engine:
        engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
        tier, _ = engine.runner.tiered.tier()
        assert "evicts first" not in engine.mode_line()
        assert tier.counters.lent == 0 and tier.counters.misses > 0  # every miss admitted, as before


def test_the_replay_of_a_recorded_trace_counts_what_the_engine_counted(tiny_dir, tmp_path, monkeypatch):
    """The engine's routing recorded under exclusive tiers, then replayed through `TieredResidentSet` at
    the engine's capacities (what `simulate --gpu-tier` runs): the tier's hits, the misses lent spare
    slots and the experts read from disk are the engine's, exactly."""
    from moestream.trace.reader import load_traces
    from moestream.trace.replay import build_replay

    path = tiny_dir("qwen3_moe")
    _, _, every, _ = _sizes(path, monkeypatch)
    host = _host_caches(path)[0]
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", "upload")
    trace = tmp_path / "t.parquet"
    with moestream.load(str(path), cache=host, trunk="ggml", gpu_tier=every // 2) as engine:
        engine.start_trace(trace, predict=False)
        engine.generate(PROMPT, max_tokens=5 * GREEDY, ignore_eos=True)
        engine.stop_trace()
        (plan,) = engine.runner.tiered.plans
        (cls,) = engine.cache.classes
        tier, _ = engine.runner.tiered.tier()
        counted, stats, top_k = tier.counters, engine.cache.stats, engine.top_k
    replay = build_replay(load_traces([str(trace)]), None, uses=True)
    tiers = TieredResidentSet(cls.capacity, plan.slots, LRUPolicy, spare=top_k, exclusive=True)
    read = 0
    for forward, uses in zip(replay.keys, replay.uses):
        read += len(tiers.access_group(forward, *uses)[1])
    assert counted.lent > 0 and counted.hits > 0
    assert (tiers.tier_hits, tiers.lent, read) == (counted.hits, counted.lent, stats.misses)

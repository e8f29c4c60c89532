"""Recording traces from the engine, and the simulator's policies reproducing the engine's misses exactly."""

from __future__ import annotations

import pytest

import moestream
from moestream.errors import MoestreamError
from moestream.trace import read_trace
from moestream.trace.simulator import simulate

PROMPTS = [[5, 17, 33, 2, 99], [41, 7, 250, 3, 3, 8, 12, 40, 100], [77]]


@pytest.mark.parametrize(
    "arch,policy",
    [
        ("qwen3_moe", "lru"),
        ("deepseek_v3", "lru"),
        ("gpt_oss", "lru"),
        ("qwen3_moe", "lfu"),
        ("gpt_oss", "lfu"),
        ("qwen3_moe", "predictive"),
        ("deepseek_v3", "predictive"),
        ("gpt_oss", "predictive"),
    ],
)
def test_simulated_policy_equals_engine(arch, policy, tiny_dir, tmp_path):
    path = tiny_dir(arch, experts=16, top_k=4)
    trace_path = tmp_path / "run.parquet"
    with moestream.load(str(path), cache="64MiB") as probe:
        slot = probe.cache.slot_bytes
    budget = 6 * slot  # 6 slots for top-4 routing over 16 experts: constant eviction
    with moestream.load(str(path), cache=budget, policy=policy) as engine:
        assert engine.cache.capacity == 6
        assert (f"{policy.upper()} eviction" in engine.mode_line()) == (policy != "lru")
        engine.start_trace(trace_path)
        seen = []
        engine.runtime.observers.append(lambda event: seen.append((event.layer, event.rows)))
        for prompt in PROMPTS:
            engine.generate(prompt, max_tokens=10, ignore_eos=True)
        stats, device_bytes = engine.cache.stats, engine.reader.bytes_read
        moe_layers = len(engine.emap.layers)
    trace = read_trace(trace_path)
    records, _, _ = simulate(trace, [policy], [budget])
    everything = [r for r in records if r["scope"] == "all"]
    assert sum(r["misses"] for r in everything) == stats.misses > 0
    assert sum(r["hits"] for r in everything) == stats.hits > 0
    assert sum(r["bytes_read"] for r in everything) == stats.miss_bytes
    # what the disk was asked for: the same experts plus at most 2 x 4 KiB of alignment per tensor part
    parts = sum(len(p) for p in next(iter(engine.emap.units.values())).values())
    assert stats.miss_bytes <= device_bytes <= stats.miss_bytes + stats.misses * parts * 8192
    rows = sum(len(rows) for _, rows in seen)
    assert len(trace) == rows and trace.header.top_k == 4 and trace.header.n_experts == 16
    assert trace.has_predictions == (moe_layers > 1)  # a prediction needs a next MoE layer
    assert not trace.header.synthetic


def test_trace_rows_match_what_the_model_routed(tiny_dir, tmp_path):
    path = tiny_dir("qwen3_moe", experts=16, top_k=4)
    with moestream.load(str(path), cache="1MiB") as engine:
        engine.start_trace(tmp_path / "t.parquet", predict=False)
        seen = []
        engine.runtime.observers.append(lambda event: seen.append((event.layer, event.rows)))
        engine.generate([5, 6, 7, 8], max_tokens=3, ignore_eos=True, request_id="alpha")
    trace = read_trace(tmp_path / "t.parquet")
    assert len(trace) == sum(len(rows) for _, rows in seen) == (4 + 2) * 2  # (prompt + 2 decode) x 2 layers
    assert not trace.has_predictions
    assert trace.experts.tolist() == [row for _, rows in seen for row in rows]
    assert trace.request_names == ["alpha"]
    assert trace.token.tolist() == [0, 1, 2, 3] * 2 + [4, 4, 5, 5]
    assert trace.phase.tolist() == [0] * 8 + [1] * 4


def test_lfu_keeps_the_tokens_and_refuses_unknown_policies(tiny_dir):
    path = str(tiny_dir("qwen3_moe", experts=16, top_k=4))
    with moestream.load(path, cache="64MiB") as probe:
        budget = 6 * probe.cache.slot_bytes
    out = {}
    for policy in ("lru", "lfu"):
        with moestream.load(path, cache=budget, policy=policy) as engine:
            out[policy] = [engine.generate(p, max_tokens=10, ignore_eos=True).tokens for p in PROMPTS]
            misses = engine.cache.stats.misses
        out[policy + " misses"] = misses
    assert out["lru"] == out["lfu"]
    assert out["lru misses"] != out["lfu misses"]  # the policy did change what was evicted
    with pytest.raises(MoestreamError, match="eviction policy 'fifo' is not one of lru, lfu, predictive"):
        moestream.load(path, cache=budget, policy="fifo")


@pytest.mark.parametrize("policy", ["lru", "lfu", "predictive"])
def test_a_layer_never_waits_for_its_own_experts_slots(policy, tiny_dir, monkeypatch):
    """A just-read expert has the lowest LFU count; it must not be the victim for the next miss of its
    own layer (that miss would wait until the first one is computed: reads serialised with compute)."""
    from moestream.cache.expert_cache import ExpertCache

    path = str(tiny_dir("qwen3_moe", experts=16, top_k=4))
    with moestream.load(path, cache="64MiB") as probe:
        budget = 6 * probe.cache.slot_bytes
    waited = []
    open_layer = ExpertCache.open_layer

    def spy(self, layer, experts, *args):
        job = open_layer(self, layer, experts, *args)
        if len(experts) <= self.capacity:  # room for the whole layer: every miss must get a slot at once
            waited.append(len(job.pending))
        return job

    monkeypatch.setattr(ExpertCache, "open_layer", spy)
    with moestream.load(path, cache=budget, policy=policy) as engine:
        for prompt in PROMPTS:
            engine.generate(prompt, max_tokens=10, ignore_eos=True)
        assert engine.cache.stats.evictions > 0
    assert len(waited) > 20 and set(waited) == {0}

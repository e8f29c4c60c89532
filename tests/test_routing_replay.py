"""--replay-routing: the engine computes the experts a recorded trace names (and prefetches its guesses),
and its misses then equal the simulator's replay of that trace."""

from __future__ import annotations

import json

import pytest

import moestream
from moestream.cli import main
from moestream.errors import MoestreamError
from moestream.synth import synthesize
from moestream.trace import read_trace
from moestream.trace.simulator import simulate

PROMPTS = [[5, 17, 33, 2, 99], [41, 7, 250, 3, 3, 8, 12, 40, 100], [77]]
SHAPE = dict(arch="qwen3_moe", layers=3, experts=16, top_k=4, dtype="fp32")


@pytest.fixture(scope="module")
def recorded(tiny_dir, tmp_path_factory):
    """A trace with predictions recorded on one checkpoint, and another checkpoint of the same layers,
    experts and top-k but twice the expert size (its own routing differs)."""
    base = tmp_path_factory.mktemp("replay")
    source = synthesize(base / "source", hidden=64, moe_intermediate=32, seed=1, **SHAPE)
    target = synthesize(base / "target", hidden=128, moe_intermediate=32, seed=2, **SHAPE)
    trace_path = base / "source.parquet"
    with moestream.load(str(source), cache="64MiB") as engine:
        engine.start_trace(trace_path)
        for i, prompt in enumerate(PROMPTS):
            engine.generate(prompt, max_tokens=12, ignore_eos=True, request_id=f"r{i}")
    return trace_path, target


def replayed_run(target, trace_path, slots: int, **options):
    with moestream.load(str(target), cache="64MiB") as probe:
        budget = slots * probe.cache.slot_bytes
    with moestream.load(str(target), cache=budget, **options) as engine:
        requests = engine.replay_routing(trace_path)
        assert "ROUTING REPLAYED from source.parquet (benchmark only" in engine.mode_line()
        seen = []
        engine.runtime.observers.append(lambda event: seen.append(event.rows))
        gens = list(engine.replay_requests())
        return engine.cache.stats, engine.cache.capacity, requests, gens, seen, engine.replay


@pytest.mark.parametrize("policy", ["lru", "lfu", "predictive"])
def test_replayed_misses_equal_the_simulators(policy, recorded) -> None:
    trace_path, target = recorded
    trace = read_trace(trace_path)
    stats, capacity, requests, gens, seen, replay = replayed_run(target, trace_path, 10, policy=policy)
    assert [(r.name, r.prompt_tokens, r.decode_tokens) for r in requests] == [
        ("r0", 5, 11),
        ("r1", 9, 11),
        ("r2", 1, 11),
    ]
    assert [len(g.tokens) for g in gens] == [12, 12, 12]
    # the experts computed are the trace's, row for row, in the order they were recorded
    assert [row for rows in seen for row in rows] == trace.experts.tolist()
    assert (replay.replayed, replay.own) == (len(trace), 0)
    slot = trace.header.slot_bytes[0]
    records, _, _ = simulate(trace, [policy], [capacity * slot])
    everything = [r for r in records if r["scope"] == "all"]
    assert sum(r["misses"] for r in everything) == stats.misses > 0
    assert sum(r["hits"] for r in everything) == stats.hits > 0


def test_replay_prefetches_the_traces_guesses(recorded, monkeypatch) -> None:
    import moestream.runtime.prefetch as gate
    from moestream.cache.expert_cache import ExpertCache

    monkeypatch.setattr(gate, "PRECISION_MIN", 0.0)  # every guess, from the first forward on
    trace_path, target = recorded
    trace = read_trace(trace_path)
    asked = []
    prefetch = ExpertCache.prefetch

    def spy(self, layer, experts):
        asked.append((layer, list(experts)))
        return prefetch(self, layer, experts)

    monkeypatch.setattr(ExpertCache, "prefetch", spy)
    stats, *_ = replayed_run(target, trace_path, 12, prefetch=True)
    # the first forward is r0's prefill at layer 0: the union of its 5 tokens' top-4 guesses for layer 1
    first = [
        row[:4]
        for row, layer, req in zip(trace.pred_experts.tolist(), trace.layer, trace.request)
        if layer == 0 and req == 0
    ][:5]
    union = list(dict.fromkeys(e for row in first for e in row))
    assert asked[0] == (1, union)
    assert len(asked) == len(PROMPTS) * 12 * 2  # every forward of layers 0 and 1
    assert stats.prefetches > 0


def test_replay_user_errors(recorded, tiny_dir, tmp_path, capsys) -> None:
    trace_path, target = recorded
    other = tiny_dir("qwen3_moe", experts=8, top_k=2)
    with moestream.load(str(other), cache="64MiB") as engine:
        with pytest.raises(MoestreamError, match="cannot be replayed here: it has 16 experts per layer"):
            engine.replay_routing(trace_path)
        with pytest.raises(MoestreamError, match="no routing is being replayed"):
            next(engine.replay_requests())
    args = ["generate", str(target), "--replay-routing", str(trace_path)]
    assert main([*args, "--trace", str(tmp_path / "t.parquet")]) == 2
    assert "cannot be used together" in capsys.readouterr().err
    assert main(["generate", str(target)]) == 2
    assert "needs --prompt" in capsys.readouterr().err
    assert main([*args, "--json", "--cache", "64MiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3 and out["rows_own_routing"] == 0 and "ROUTING REPLAYED" in out["mode"]

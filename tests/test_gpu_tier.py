"""A GPU tier smaller than the experts (`--gpu-tier`, engine/gpu_tier.py), checked on ggml's CPU backend
(the device path CUDA runs, here without a GPU): a graph a layer, each layer's routed experts placed in
device slots by the policy and uploaded from the host cache on a miss, computed from there by the next
graph. The logits and greedy tokens equal the in-place CPU graphs' and the every-expert-on-device path's
bit for bit at every tier size (the same kernels over the same bytes); the counters say what was uploaded.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import moestream
from moestream.engine.gpu_tier import minimum_budget
from moestream.engine.host_misses import HostMisses
from moestream.engine.options import EngineOptions
from moestream.errors import CacheBudgetError, MoestreamError

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]
GREEDY = 8


def _mixed_down(layer: int, kind: str) -> Q:
    """Q4_0 experts but for odd layers' down, Q8_0: two size classes of other bytes per kind."""
    return Q.Q8_0 if kind == "down" and layer % 2 else Q.Q4_0


def _model(which: str, tiny_dir, tiny_gguf):
    if which == "mixed_gguf":
        return tiny_gguf("qwen3_moe", ftype=Q.Q8_0, expert_type=_mixed_down)[1]
    return tiny_dir(which)


def _run(path, monkeypatch, backend: str, **load) -> tuple[torch.Tensor, list[int], str]:
    """(prefill and forced-decode logits, greedy tokens, the mode line)."""
    from test_ggml_runner import _runner_logits

    if backend:
        monkeypatch.setenv("MOESTREAM_GGML_BACKEND", backend)
    else:
        monkeypatch.delenv("MOESTREAM_GGML_BACKEND", raising=False)
    with moestream.load(str(path), cache="64MiB", trunk="ggml", **load) as engine:
        logits = _runner_logits(engine, PROMPT)
        gen = engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
        return logits, gen.tokens, engine.mode_line()


def _sizes(path, monkeypatch) -> tuple[int, int, int, list]:
    """(the smallest tier, a middle one, one for every expert) of this model, and its size classes."""
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier="1GiB") as engine:
        r = engine.runner
        plans = r.tiered.plans
        types, n = r.experts.graph_types(), r.experts.num_experts
        least = minimum_budget(types, r._moe_layers, r.spec.hidden, n, r.spec.top_k)
        every = sum(p.slots * p.slot_bytes for p in plans)
    return least, (least + every) // 2, every, plans


@pytest.mark.parametrize("misses", ["upload", "host", "split"])
@pytest.mark.parametrize("which", ["qwen3_moe", "mixed_gguf", "mixtral", "gpt_oss"])
def test_a_gpu_tier_gives_the_in_place_bits_at_every_size(which, misses, tiny_dir, tiny_gguf, monkeypatch):
    """Misses copied to their slots before the graph (upload), or computed by the CPU from the host cache
    and picked by the graph beside the device's hits (host): the same bits either way."""
    path = _model(which, tiny_dir, tiny_gguf)
    want, want_tokens, _ = _run(path, monkeypatch, "")
    every_on_device, device_tokens, _ = _run(path, monkeypatch, "cpu")
    assert torch.equal(every_on_device, want) and device_tokens == want_tokens
    least, middle, every, plans = _sizes(path, monkeypatch)
    if which == "mixed_gguf":  # Q4_0 and Q8_0 downs: each class's down slots of their own bytes
        downs = sorted(dict(p.kinds)["down"] for p in plans)
        assert len(plans) == 2 and downs[0] < downs[1]
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
    words = {
        "upload": "misses copied before their graph",
        "host": "misses computed by the CPU from it",
        "split": "misses 50% copied before their graph while the CPU computes the rest",
    }
    calls = []  # the host way's misses: by one CPU graph a layer over the host cache's slots
    shared = []  # (column count, the layers with a graph of it, the x buffers of those graphs)
    compute = HostMisses.compute

    def counted(self, *a):
        calls.append(len(a[2]))
        out = compute(self, *a)
        for columns in {c for _, c in self._graphs}:
            graphs = [g for (_, c), g in self._graphs.items() if c == columns]
            shared.append((columns, len(graphs), {g.x.data_ptr() for g in graphs}))
        return out

    monkeypatch.setattr(HostMisses, "compute", counted)
    for size in (least, middle, every):
        got, tokens, mode = _run(path, monkeypatch, "cpu", gpu_tier=size)
        assert "routed experts in a GPU tier of" in mode and words[misses] in mode
        assert torch.equal(got, want), (which, size)
        assert tokens == want_tokens
    assert bool(calls) == (misses != "upload")
    # the graphs of one column count share their host buffers across layers (one set per count)
    assert all(len(ptrs) == 1 for _, _, ptrs in shared)
    assert (misses == "upload") or any(layers > 1 for _, layers, _ in shared)


def test_counters_every_expert_held_uploads_nothing_after_warm_up(tiny_dir, monkeypatch):
    """A tier with a slot for every expert uploads each once: a request repeated uploads nothing, every
    expert a hit. The smallest tier (a token's experts per class) uploads on every decoded token, each miss
    one slot's bytes; the stats the engine reports (its JSON) carry the figures."""
    from test_ggml_runner import _runner_logits

    path = tiny_dir("qwen3_moe")
    least, _, every, plans = _sizes(path, monkeypatch)
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=every) as engine:
        engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
        _runner_logits(engine, PROMPT)
        gen = engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
        tier = gen.stats.to_dict()["device_tier"]
        assert tier["bytes_uploaded"] == 0 and tier["hit_rate"] == 1.0
        assert gen.stats.decode.device_hits == (GREEDY - 1) * engine.top_k * len(plans[0].layers)
    (plan,) = plans
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=least) as engine:
        assert engine.runner.tiered.plans[0].slots == engine.top_k
        gen = engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
        d = gen.stats.decode
        assert d.device_misses >= d.tokens and d.device_bytes == d.device_misses * plan.slot_bytes
        assert "gpu tier hit rate" in gen.stats.line() and gen.stats.line().endswith("misses: upload")
        assert gen.stats.to_dict()["device_tier"]["way"] == "upload"
        assert engine.counters().tier.misses >= d.device_misses


def test_a_tier_too_small_for_a_tokens_experts_is_refused(tiny_dir, monkeypatch):
    path = tiny_dir("qwen3_moe")
    least, *_ = _sizes(path, monkeypatch)
    with pytest.raises(CacheBudgetError) as err:
        moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=least - 1)
    text = str(err.value)
    assert text.startswith("--gpu-tier") and "give it at least" in text and "\n" not in text


def test_a_gpu_tier_without_a_backend_is_refused(tiny_dir, monkeypatch):
    monkeypatch.delenv("MOESTREAM_GGML_BACKEND", raising=False)
    with pytest.raises(MoestreamError, match="run with --device cuda"):
        moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB", trunk="ggml", gpu_tier="1MiB")
    with pytest.raises(ValueError, match="on the torch CUDA path the GPU tier is --gpu-cache"):
        EngineOptions(gpu_tier="1MiB", device="cuda")


@pytest.mark.parametrize("misses", ["upload", "host", "split"])
def test_generate_batch_over_a_gpu_tier_with_parallel_slots(misses, tiny_dir, monkeypatch):
    """--gpu-tier with --parallel 3: `generate_batch` decodes the prompts together (steps of several rows
    over the tier), each getting its tokens alone."""
    path = tiny_dir("qwen3_moe")
    _, middle, *_ = _sizes(path, monkeypatch)
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
    prompts = [PROMPT, PROMPT[3:] + [9, 10], [7, 7, 250, 1]]
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=middle, parallel=3) as engine:
        want = [engine.generate(p, max_tokens=GREEDY, ignore_eos=True).tokens for p in prompts]
        rows = engine.batch.decode_rows
        got = engine.generate_batch(prompts, max_tokens=GREEDY, ignore_eos=True)
        batched = engine.batch.decode_rows - rows
    assert [g.tokens for g in got] == want
    # every decoded row went through the batch's steps; how many shared a step depends on when each
    # request's thread joined (test_batch_runner's tier test steps several rows together by schedule)
    assert batched == 3 * (GREEDY - 1)


def test_generate_batch_with_a_gpu_tier_runs_the_prompts_in_turn(tiny_dir, monkeypatch):
    """With --parallel 1 (the default) a GPU tier serves `generate_batch` one prompt after another, each
    its tokens alone."""
    path = tiny_dir("qwen3_moe")
    _, middle, *_ = _sizes(path, monkeypatch)
    prompts = [PROMPT, PROMPT[3:] + [9, 10]]
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=middle) as engine:
        assert engine.batch is None
        want = [engine.generate(p, max_tokens=GREEDY, ignore_eos=True).tokens for p in prompts]
        got = engine.generate_batch(prompts, max_tokens=GREEDY, ignore_eos=True)
    assert [g.tokens for g in got] == want


def test_tier_misses_is_said_or_refused(tiny_dir, monkeypatch):
    """MOESTREAM_TIER_MISSES: a value of neither way, or set without a GPU tier, is refused in a sentence."""
    from moestream.ggml.lib import GgmlUnavailableError

    path = str(tiny_dir("qwen3_moe"))
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", "cpu")
    with pytest.raises(GgmlUnavailableError, match="say upload, host, split or auto"):
        moestream.load(path, cache="64MiB", trunk="ggml", gpu_tier="1MiB")
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", "split")
    monkeypatch.setenv("MOESTREAM_TIER_SPLIT", "2")
    with pytest.raises(GgmlUnavailableError, match="MOESTREAM_TIER_SPLIT='2': say a share from 0 to 1"):
        moestream.load(path, cache="64MiB", trunk="ggml", gpu_tier="1MiB")
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", "host")
    with pytest.raises(GgmlUnavailableError, match="there is no GPU tier"):
        moestream.load(path, cache="64MiB", trunk="ggml")


@pytest.mark.parametrize("misses", ["upload", "host", "split"])
def test_chunks_and_a_restream_with_a_gpu_tier(misses, tiny_dir, monkeypatch):
    """Prefill chunks (each layer's union of a chunk beyond the smallest tier: computed from the host),
    spans across graph sets, and a restream (the tier made again over the new host slots)."""
    from test_ggml_runner import _runner_logits, _small_steps

    from moestream.engine import ggml_runner

    _small_steps(monkeypatch)
    monkeypatch.setattr(ggml_runner, "DEVICE_CHUNK", 5)
    path = tiny_dir("qwen3_moe")
    want, _, _ = _run(path, monkeypatch, "")
    least, middle, _, _ = _sizes(path, monkeypatch)
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
    for size in (least, middle):
        with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=size) as engine:
            assert torch.equal(_runner_logits(engine, PROMPT), want)
            engine.restream(cache="32MiB", preload=True)
            assert torch.equal(_runner_logits(engine, PROMPT), want)


OTHER_FAMILIES = ["qwen2_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3", "gpt_oss_mxfp4"]


@pytest.mark.parametrize("arch", [*OTHER_FAMILIES, "qwen3_next", "qwen3_5_moe"])
def test_every_family_with_a_gpu_tier(arch, tiny_dir, monkeypatch):
    """The other families (dense first layers, shared experts, MLA, linear attention, MXFP4): the smallest
    tier each way gives the in-place bits (prefill and decode)."""
    from test_ggml_runner import _runner_logits

    path = tiny_dir(arch)
    want, _, _ = _run(path, monkeypatch, "")
    least, *_ = _sizes(path, monkeypatch)
    for misses in ("upload", "host", "split"):
        monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
        with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=least) as engine:
            assert torch.equal(_runner_logits(engine, PROMPT), want), misses


def test_layer_graphs_copy_only_the_routing_and_the_experts_outputs(tiny_dir, monkeypatch):
    """Between a tiered step's layer graphs only the routing crosses (and the host's expert outputs): the
    residual stream and the experts' input stay on the device, the step's inputs go once a step."""
    path = tiny_dir("qwen3_moe")
    _, middle, *_ = _sizes(path, monkeypatch)
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=middle) as engine:
        engine.generate(PROMPT, max_tokens=3, ignore_eos=True)
        (gs,) = [gs for (t, *_), gs in engine.runner._sets.items() if t == 1][-1:]
        graphs, fused = gs.layer_graphs()
        crossing = {r.name for net in [*graphs, *fused.values()] for r, _, _ in net._inputs + net._outputs}
    assert crossing <= {"order", "weights0", "weights1", "slots", "outputs", "logits"}, crossing
    assert {"order", "slots", "logits"} <= crossing


@pytest.mark.parametrize("misses", ["upload", "host"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_tier_misses_what_the_simulators_resident_sets_miss(policy, misses, tiny_dir, monkeypatch):
    """The tier's residency is `cache/policy`'s (the classes the simulator replays): the layers' routing it
    placed, replayed through fresh `ResidentSet`s of its classes' slots, misses exactly as often; where
    the CPU computes the misses, with the same `FrequencyGate` admitting them (and fewer copies)."""
    from moestream.cache.admission import FrequencyGate
    from moestream.cache.policy import ResidentSet, execution_order
    from moestream.engine.gpu_tier import GpuTier
    from moestream.runtime.streaming import POLICY_CLASSES

    seen = []
    place = GpuTier.place

    def recorded(self, layer, rows, gated=False):
        out = place(self, layer, rows, gated)
        if out is not None:
            seen.append((layer, rows, gated))
        return out

    monkeypatch.setattr(GpuTier, "place", recorded)
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
    path = tiny_dir("qwen3_moe")
    least, *_ = _sizes(path, monkeypatch)
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=least, policy=policy) as engine:
        engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True)
        counters = engine.runner.tier_counters()
        measured = counters.misses
        (plan,) = engine.runner.tiered.plans
    replay = ResidentSet(plan.slots, POLICY_CLASSES[policy]())
    gate = FrequencyGate()
    simulated = admitted = 0
    for layer, rows, gated in seen:
        assert gated == (misses == "host")
        keys = [(layer, e) for e in execution_order(rows)]
        uses = [sum(row.count(e) for row in rows) for _, e in keys]
        gate.count(keys, uses)
        missed = replay.access_group(keys, uses, len(rows), gate.admits if gated else None)[1]
        simulated += len(missed)
        admitted += sum(key in replay for key in missed)
    assert seen and simulated == measured
    # every admitted miss is copied in once (a whole expert), and no other
    assert counters.bytes_uploaded == admitted * plan.slot_bytes
    if misses == "host":  # the gate kept some out
        assert admitted < simulated


def test_a_rows_ids_stay_distinct_where_the_gate_kept_misses_out():
    """A miss without a device slot takes one its token's other experts do not hold (ids distinct per
    token, as a router's are)."""
    from moestream.engine.tiered_steps import row_slots

    assert row_slots({3: 0, 5: 2}, [5, 9, 3, 7]) == [2, 1, 0, 3]
    assert row_slots({}, [4, 1]) == [0, 1]


def test_the_way_split_copies_a_batch_steps_most_used_misses():
    """The way split's copies: a decoded token's first misses in order; in a step of several rows the
    misses with the most (token, expert) pairs, ties in their order, so the CPU keeps the fewest."""
    from moestream.engine.tiered_steps import split_copied

    assert split_copied([9, 4, 6], [[1, 9, 4, 6]], 0.5) == [9, 4]  # round(1.5) = 2, in order
    rows = [[1, 2, 3], [1, 3, 5], [7, 3, 1], [8, 1, 2]]
    rest = [2, 3, 5, 1]  # uses 2, 3, 1, 4
    assert split_copied(rest, rows, 0.5) == [1, 3]
    assert split_copied(rest, rows, 0.75) == [1, 3, 2]
    assert split_copied(rest, rows, 1.0) == rest and split_copied(rest, rows, 0.0) == []
    assert split_copied([5, 7, 8], rows, 0.5) == [5, 7]  # each used once: in order


def test_a_batch_step_of_the_way_split_copies_its_most_used_misses(tiny_dir, monkeypatch):
    """In the engine: every batch step over a tier, way split, copies in misses used at least as often as
    each one the CPU keeps (the tier's admissions of the split's copies, seen as they happen)."""
    from test_batch_runner import PROMPTS, _together

    from moestream.engine import tiered_steps
    from moestream.engine.gpu_tier import GpuTier

    path = tiny_dir("qwen3_moe")
    _, middle, *_ = _sizes(path, monkeypatch)
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", "split")
    seen = []  # (rows, the misses left, copied)
    choose = tiered_steps.split_copied

    def spy(rest, rows, share):
        copied = choose(rest, rows, share)
        seen.append((rows, rest, copied))
        return copied

    monkeypatch.setattr(tiered_steps, "split_copied", spy)
    admitted = []
    admit = GpuTier.admit
    monkeypatch.setattr(
        GpuTier, "admit", lambda self, layer, e, g: admitted.append(list(e)) or admit(self, layer, e, g)
    )
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=middle, parallel=3) as engine:
        _together(engine.runner, PROMPTS[:3])
    batched = [
        (rows, rest, copied) for rows, rest, copied in seen if len(rows) > 1 and 0 < len(copied) < len(rest)
    ]
    assert batched, "no batch step split its misses"
    assert [copied for *_, copied in seen] == admitted  # what the tier admitted is what was chosen
    for rows, rest, copied in batched:
        uses = {e: sum(row.count(e) for row in rows) for e in rest}
        assert min(uses[e] for e in copied) >= max(uses[e] for e in rest if e not in copied)


def test_a_way_trial_chooses_the_faster_way_by_its_median_step():
    from moestream.engine.gpu_tier import WayTrial

    trial = WayTrial(window=3)
    ways = []
    # upload: 10, 30, 12 ms; host: 20, 9, 8 ms; split: 7, 6, 9 ms
    for seconds in (0.010, 0.030, 0.012, 0.020, 0.009, 0.008, 0.007, 0.006, 0.009):
        ways.append(trial.way())
        if ways[-1] == "split":  # the share from the first two: host / (upload + host) = 9 / 21
            assert trial.share() == pytest.approx(9 / 21)
        trial.record(ways[-1], seconds)
    assert ways == ["upload"] * 3 + ["host"] * 3 + ["split"] * 3 and trial.chosen == "split"
    assert trial.describe() == "split (a decode step 7.0 ms; upload 12.0, host 9.0; split copied 43%)"
    trial.record("upload", 0.001)  # after the choice: nothing changes it
    assert trial.way() == "split" and len(trial.seconds["upload"]) == 3


def test_the_auto_way_tries_each_way_then_keeps_one_with_the_same_bits(tiny_dir, monkeypatch):
    """MOESTREAM_TIER_MISSES=auto: 8 decode steps copy misses in, 8 compute them on the CPU, 8 do both,
    then one way goes on; every token the CPU graphs' (each way gives them on ggml's CPU backend)."""
    path = tiny_dir("qwen3_moe")
    least, *_ = _sizes(path, monkeypatch)
    monkeypatch.delenv("MOESTREAM_GGML_BACKEND", raising=False)
    with moestream.load(str(path), cache="64MiB", trunk="ggml") as engine:
        want = engine.generate(PROMPT, max_tokens=30, ignore_eos=True).tokens
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", "auto")
    calls = []
    compute = HostMisses.compute
    monkeypatch.setattr(HostMisses, "compute", lambda self, *a: calls.append(len(a[2])) or compute(self, *a))
    with moestream.load(str(path), cache="64MiB", trunk="ggml", gpu_tier=least) as engine:
        assert "as a trial of the first 24 decoded tokens finds faster" in engine.mode_line()
        got = engine.generate(PROMPT, max_tokens=30, ignore_eos=True).tokens
        trial = engine.runner.tiered.trial
        uploaded = engine.runner.tier_counters().bytes_uploaded
        assert engine.counters().tier.way == f"auto: {trial.describe()}" and trial.chosen in trial.describe()
    assert got == want
    assert trial.chosen in trial.WAYS and [len(v) for v in trial.seconds.values()] == [8, 8, 8]
    assert calls and uploaded > 0  # both ways ran


def test_auto_tier_sizes_from_the_free_memory():
    from moestream.engine.gpu_tier import AUTO_MARGIN, auto_tier

    gib = 1 << 30
    assert auto_tier(80 * gib, 4 * gib, 8 * gib, gib // 8, holds_all=True) is None  # they all fit
    left = 20 * gib - 4 * gib - 20 * gib // 20
    assert auto_tier(20 * gib, 4 * gib, 30 * gib, gib // 8, holds_all=True) == left
    # room for every expert, but the host cache streams: slots for every expert, not the one-graph step
    assert auto_tier(80 * gib, 4 * gib, 8 * gib, gib // 8, holds_all=False) == 8 * gib
    with pytest.raises(CacheBudgetError, match=r"--gpu-tier auto: the GPU has 5\.0 GiB free"):
        auto_tier(5 * gib, 4 * gib, 8 * gib, gib, holds_all=True)
    assert AUTO_MARGIN == 512 << 20


def test_gpu_tier_auto_puts_every_expert_on_the_device_or_sizes_a_tier(tiny_dir, monkeypatch):
    """--gpu-tier auto on ggml's CPU backend, its free memory given: room for every expert, the step is one
    graph with them all on the device; half as much, a tier of what is left; too little, refused in a
    sentence; a backend that does not say, refused too. Tokens the CPU graphs' throughout."""
    from moestream.engine import ggml_runner
    from moestream.engine.gpu_tier import AUTO_MARGIN
    from moestream.ggml.backend import Backend
    from moestream.ggml.lib import GgmlUnavailableError

    path = str(tiny_dir("qwen3_moe"))
    monkeypatch.delenv("MOESTREAM_GGML_BACKEND", raising=False)
    with moestream.load(path, cache="64MiB", trunk="ggml") as engine:
        want = engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True).tokens
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    with pytest.raises(GgmlUnavailableError, match="backend does not say its free memory; give --gpu-tier a"):
        moestream.load(path, cache="64MiB", trunk="ggml", gpu_tier="auto")
    asked = []
    choose = ggml_runner.auto_tier
    monkeypatch.setattr(ggml_runner, "auto_tier", lambda *a: asked.append(a) or choose(*a))
    free = [1 << 40]
    monkeypatch.setattr(Backend, "memory", lambda self: (free[0], 2 << 40))
    with moestream.load(path, cache="64MiB", trunk="ggml", gpu_tier="auto") as engine:
        assert (
            engine.runner.tiered is None
            and "--gpu-tier auto: every expert on the device" in engine.mode_line()
        )
        assert engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True).tokens == want
    _, reserve, every, least, holds_all = asked[-1]
    assert holds_all and 0 < least < every and reserve > 0
    free[0] = reserve + AUTO_MARGIN + every // 2  # the margin (free's 1/20 is less here), half the experts
    with moestream.load(path, cache="64MiB", trunk="ggml", gpu_tier="auto") as engine:
        tiered = engine.runner.tiered
        assert tiered is not None and "--gpu-tier auto: a tier of" in engine.mode_line()
        assert sum(p.slots * p.slot_bytes for p in tiered.plans) < every
        assert engine.generate(PROMPT, max_tokens=GREEDY, ignore_eos=True).tokens == want
    free[0] = reserve
    with pytest.raises(CacheBudgetError, match="--gpu-tier auto: the GPU has"):
        moestream.load(path, cache="64MiB", trunk="ggml", gpu_tier="auto")

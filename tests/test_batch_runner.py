"""Several sequences in one step of the ggml runner (`--parallel N`): each in its own KV-cache slot, one
token of each decoded as one step of B rows.

Oracle: the same runner with each sequence run alone (prefill, then a step a token, in slot 0): every
logit of every step bit for bit (the batched step's products take ggml's vec_dot for every row, as a
one-row step does; from 8 rows, a K-quant matrix's in groups of at most 7: tests/test_batch_tiled.py;
attention runs per sequence over its own slot), at every budget (every expert
cached: one graph a step; a few slots: experts streamed between the layers' graphs).
"""

from __future__ import annotations

import pytest
import torch

import moestream
from moestream.engine import ggml_runner
from moestream.errors import MoestreamError
from moestream.graphs import layers

PROMPTS = [[5, 17, 33, 2, 99, 41, 7], [250, 3, 12, 80], [9, 150, 77, 31, 200, 6, 18, 42, 1, 2, 3], [64, 7]]
STEPS = 10
BATCHED = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "glm4_moe", "gpt_oss", "deepseek_v2", "deepseek_v3"]


def _alone(runner, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and every step's logits [STEPS, V] of `prompt` run alone (slot 0)."""
    logits, kv = runner(prompt, None)
    tokens, seen = [], []
    for _ in range(STEPS):
        tokens.append(int(logits.argmax()))
        seen.append(logits)
        logits, kv = runner([tokens[-1]], kv)
    return tokens, torch.stack(seen)


def _stepped(runner, prompts, schedule, partial=False, after=None):
    """The prompts each prefilled in a slot of its own, then a decode step of the rows each tuple of
    `schedule` names (a token of each); a sequence that has its STEPS tokens leaves the tuple (`partial`)
    or the tuple is skipped: each sequence's greedy tokens and its logits at each of them [tokens, V].
    `after()` runs after each step."""
    seqs = runner.seqs[: len(prompts)]
    logits = []
    for kv, prompt in zip(seqs, prompts):
        kv.tokens = 0
        logits.append(runner(prompt, kv)[0])
    tokens: list[list[int]] = [[] for _ in prompts]
    seen: list[list[torch.Tensor]] = [[] for _ in prompts]
    for rows in schedule:
        left = [i for i in rows if len(seen[i]) < STEPS]
        if not left or (len(left) < len(rows) and not partial):
            continue
        for i in left:
            tokens[i].append(int(logits[i].argmax()))
            seen[i].append(logits[i])
        for i, row in zip(left, runner.decode([(seqs[i], tokens[i][-1]) for i in left])):
            logits[i] = row
        if after is not None:
            after()
    return tokens, [torch.stack(s) for s in seen]


def _together(runner, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The same, the prompts each prefilled in a slot of its own, then decoded together a token a step."""
    return _stepped(runner, prompts, [tuple(range(len(prompts)))] * STEPS)


def _as_alone(alone, tokens, seen) -> None:
    """Each sequence's tokens and logits so far are those it got alone."""
    for i, (want_tokens, want) in enumerate(alone):
        got = seen[i]
        assert tokens[i] == want_tokens[: len(tokens[i])] and torch.equal(got, want[: len(got)]), i


@pytest.mark.parametrize("arch", BATCHED)
def test_a_batched_decode_step_gives_each_sequence_its_logits_alone(arch, tiny_dir):
    with moestream.load(str(tiny_dir(arch)), cache="64MiB", trunk="ggml", parallel=4) as engine:
        runner = engine.runner
        assert (
            len(runner.seqs) == 4 and "KV cache F16 of 256 positions in each of 4 slots" in engine.mode_line()
        )
        assert engine.mode_line().endswith(", parallel 4")
        alone = [_alone(runner, p) for p in PROMPTS]
        tokens, seen = _together(runner, PROMPTS)
    for (want_tokens, want), got_tokens, got in zip(alone, tokens, seen):
        assert got_tokens == want_tokens
        assert torch.equal(got, want), (arch, (got - want).abs().max().item())


def test_streamed_experts_and_spans_in_a_batch(tiny_dir, monkeypatch):
    """A budget of a few slots (each layer's experts read between graphs), spans of 8 positions (the
    batch crosses them), prefill chunks of 5 tokens: the same bits as alone; three sequences of four
    slots, then two."""
    monkeypatch.setattr(ggml_runner, "CHUNK", 5)
    monkeypatch.setattr(ggml_runner, "SPAN_STEP", 8)
    monkeypatch.setattr(layers, "SPAN_STEP", 8)
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="150KiB", trunk="ggml", parallel=4) as engine:
        runner = engine.runner
        assert engine.counters().misses == 0 and engine.runner.experts.resident_slots() is None
        alone = [_alone(runner, p) for p in PROMPTS[:3]]
        for n in (3, 2):
            tokens, seen = _together(runner, PROMPTS[:n])
            for (want_tokens, want), got_tokens, got in zip(alone, tokens, seen):
                assert got_tokens == want_tokens and torch.equal(got, want)
        assert engine.counters().misses > 0  # experts were read between the graphs


@pytest.mark.parametrize(
    "arch,cache", [("qwen3_moe", "64MiB"), ("qwen3_moe", "150KiB"), ("deepseek_v2", "64MiB")]
)
def test_one_graph_set_serves_a_batch_in_any_slots(arch, cache, tiny_dir):
    """Batches of two rows in slots that change each step ((0, 1), (2, 3), (0, 3), (1, 2), (3, 0), ...):
    one decode set of two rows for them all (its keys and values pointed at each step's slots, every
    expert cached: one graph a step; a few slots: a graph a layer), and each sequence's logits at each
    of its tokens the bits it gets alone."""
    with moestream.load(str(tiny_dir(arch)), cache=cache, trunk="ggml", parallel=4) as engine:
        runner = engine.runner
        alone = [_alone(runner, p) for p in PROMPTS]
        built = []

        def one_set() -> None:  # of two rows, the same one every step
            sets = [gs for key, gs in runner._sets.items() if key[2] == 2]
            assert len(sets) == 1 and (not built or sets[0] is built[0])
            built[:] = sets

        pairs = [(0, 1), (2, 3), (0, 3), (1, 2), (3, 0), (2, 1)] * STEPS
        tokens, seen = _stepped(runner, PROMPTS, pairs, after=one_set)
    _as_alone(alone, tokens, seen)
    assert all(len(got) >= STEPS - 2 for got in seen)


def test_decode_refuses_a_slot_twice_and_a_foreign_cache(tiny_dir):
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB", trunk="ggml", parallel=2) as engine:
        runner = engine.runner
        kv = runner.seqs[0]
        with pytest.raises(ValueError, match="each KV slot once"):
            runner.decode([(kv, 1), (kv, 2)])
        with pytest.raises(RuntimeError, match="only its own KV cache"):
            runner.decode([(object(), 1), (runner.seqs[1], 2)])


def test_parallel_is_refused_where_it_cannot_run(tiny_dir):
    with pytest.raises(
        MoestreamError, match="--parallel 2 is not possible for qwen3_next: its linear-attention"
    ):
        moestream.load(str(tiny_dir("qwen3_next")), cache="64MiB", trunk="ggml", parallel=2)
    with pytest.raises(MoestreamError, match=r"--parallel 2 needs the ggml graphs .*--trunk eager"):
        moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB", trunk="eager", parallel=2)
    with pytest.raises(MoestreamError, match="--parallel must be between 1 and 64, got 0"):
        moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB", parallel=0)


def test_the_memory_plan_counts_a_kv_cache_per_slot(tiny_dir):
    path = str(tiny_dir("qwen3_moe"))
    sizes = {}
    for n in (1, 3):
        with moestream.load(path, cache="64MiB", trunk="ggml", parallel=n) as engine:
            sizes[n] = (engine.loaded.kv_bytes, engine.runner.kv_bytes)
    assert sizes[3] == (3 * sizes[1][0], 3 * sizes[1][1])


@pytest.mark.parametrize("query", ["copy", "reshape"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_batch_on_a_ggml_backend_gives_each_sequence_its_logits_alone(arch, query, tiny_dir, monkeypatch):
    """ggml's CPU backend through the device path (buffers copied in and out, the KV cache and the
    expert stacks on the device), as ggml's CUDA backend runs the graphs: the same bits alone and batched,
    flash attention's one-token queries copied or reshaped (MOESTREAM_GGML_QUERY)."""
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    monkeypatch.setattr("moestream.ggml.net._QUERY", query)
    with moestream.load(str(tiny_dir(arch)), cache="64MiB", trunk="ggml", parallel=3) as engine:
        runner = engine.runner
        assert runner.memory is not None
        alone = [_alone(runner, p) for p in PROMPTS[:3]]
        tokens, seen = _together(runner, PROMPTS[:3])
    for (want_tokens, want), got_tokens, got in zip(alone, tokens, seen):
        assert got_tokens == want_tokens and torch.equal(got, want)


@pytest.mark.parametrize("host", ["every", "half"])
@pytest.mark.parametrize("misses", ["upload", "host", "split"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_batch_over_a_gpu_tier_gives_each_sequence_its_logits_alone(
    arch, misses, host, tiny_dir, monkeypatch
):
    """A GPU tier of the smallest size (a token's experts a class: a batch's union overflows it and runs on
    the host, or fits and misses), on ggml's CPU backend, each way of a miss, over a host cache holding
    every expert or about half (exclusive tiers: a batch's misses beyond the spare slots admitted): the
    same bits alone and batched, each layer's union of the rows' experts placed once."""
    from test_gpu_tier import _sizes
    from test_gpu_tier_streamed import _host_caches

    from moestream.engine.gpu_tier import GpuTier

    rows_placed = []
    place = GpuTier.place
    monkeypatch.setattr(
        GpuTier,
        "place",
        lambda self, layer, rows, *a: rows_placed.append(len(rows)) or place(self, layer, rows, *a),
    )
    path = tiny_dir(arch)
    cache = "64MiB" if host == "every" else _host_caches(path)[1]  # (before the tier's variables)
    monkeypatch.setenv("MOESTREAM_GGML_BACKEND", "cpu")
    monkeypatch.setenv("MOESTREAM_TIER_MISSES", misses)
    least, middle, *_ = _sizes(path, monkeypatch)
    for size in (least, middle):
        with moestream.load(str(path), cache=cache, trunk="ggml", parallel=3, gpu_tier=size) as engine:
            runner = engine.runner
            assert runner.tiered is not None and engine.mode_line().endswith(", parallel 3")
            alone = [_alone(runner, p) for p in PROMPTS[:3]]
            tokens, seen = _together(runner, PROMPTS[:3])
            placed = runner.tier_counters()
        assert placed.hits + placed.misses > 0 and 3 in rows_placed  # a step of the batch's 3 rows
        for (want_tokens, want), got_tokens, got in zip(alone, tokens, seen):
            assert got_tokens == want_tokens and torch.equal(got, want), (arch, misses, size)


def test_requests_joining_and_leaving_reuse_the_decode_sets(tiny_dir):
    """Four slots, the batch's rows changing every step (1, 2, 3, 4, 3, 2 rows, in changing slots): once
    each row count and lone slot has been seen, a step builds no graph set (a set per lone slot and per
    row count is kept: `decode_sets`), and every sequence still gets its logits alone."""
    pattern = [(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (1, 2, 3), (2, 3), (3,), (1,), (2,), (1, 3)]
    with moestream.load(str(tiny_dir("qwen3_moe")), cache="64MiB", trunk="ggml", parallel=4) as engine:
        runner = engine.runner
        alone = [_alone(runner, p) for p in PROMPTS]
        built = []  # the graph sets after each step
        tokens, seen = _stepped(
            runner,
            PROMPTS,
            pattern * 3,
            partial=True,
            after=lambda: built.append({id(gs) for gs in runner._sets.values()}),
        )
    first = len(pattern)  # steps of the first pass, each row count and lone slot seen
    assert all(later <= built[first - 1] for later in built[first:]), "a set was built again"
    _as_alone(alone, tokens, seen)


CAPACITY = """
import sys, torch, moestream
with moestream.load(sys.argv[1], cache="64MiB", trunk="ggml", parallel=40, ctx_size=16) as engine:
    runner = engine.runner
    prompts = [[5 + i, 17 + i] for i in range(40)]
    alone = [runner([3], runner(p, None)[1])[0] for p in prompts]
    for kv, p in zip(runner.seqs, prompts):
        kv.tokens = 0
        runner(p, kv)
    rows = runner.decode([(kv, 3) for kv in runner.seqs])
    assert all(torch.equal(row, a) for row, a in zip(rows, alone))
    print("ok")
"""


def test_a_whole_step_of_forty_sequences_fits_its_graph(tmp_path):
    """A batch's attention takes a few nodes a sequence in every layer: a step of 40 sequences over 6
    layers, every expert cached (the whole step one graph), overflowed the 1024 nodes the graph had
    (ggml aborts: run in a process of its own); each row still gets its logits alone."""
    import subprocess
    import sys

    from tiny_models import write_tiny

    path = write_tiny("qwen3_moe", tmp_path / "hf", num_hidden_layers=6)
    done = subprocess.run(
        [sys.executable, "-c", CAPACITY, str(path)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def _side_by_side(runner, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Rounds of `runner.together`: prompt i joins at round i, fed a chunk a round, beside the decode step
    of the sequences whose prompts are in (a token each, until each has STEPS logits): each sequence's
    greedy tokens and its logits at each of them [STEPS, V]."""
    seqs, n = runner.seqs[: len(prompts)], len(prompts)
    fed, logits = [0] * n, [None] * n
    tokens: list[list[int]] = [[] for _ in prompts]
    seen: list[list[torch.Tensor]] = [[] for _ in prompts]
    for kv in seqs:
        kv.tokens = 0
    for round_ in range(100):
        decoding = [i for i in range(n) if fed[i] == len(prompts[i]) and len(seen[i]) < STEPS]
        for i in decoding:
            tokens[i].append(int(logits[i].argmax()))
            seen[i].append(logits[i])
        decoding = [i for i in decoding if len(seen[i]) < STEPS]
        chunks = [i for i in range(min(round_ + 1, n)) if fed[i] < len(prompts[i])]
        if not decoding and not chunks:
            break
        out = runner.together(
            [(seqs[i], tokens[i][-1]) for i in decoding],
            [(prompts[i][fed[i] : fed[i] + runner.chunk], seqs[i]) for i in chunks],
        )
        if decoding:
            for i, row in zip(decoding, out.pop(0)):
                logits[i] = row
        for i, last in zip(chunks, out):
            fed[i] = min(fed[i] + runner.chunk, len(prompts[i]))
            logits[i] = last
    return tokens, [torch.stack(s) for s in seen]


@pytest.mark.parametrize(
    "arch,cache",
    [("qwen3_moe", "150KiB"), ("gpt_oss", "400KiB"), ("deepseek_v2", "150KiB"), ("mixtral", "300KiB")],
)
def test_a_rounds_steps_side_by_side_give_each_sequence_its_logits_alone(arch, cache, tiny_dir, monkeypatch):
    """Experts streamed through a few slots: a round's decode step and prompt chunks run a layer at a time
    side by side (`together`), each by the schedule; every sequence gets the bits it gets alone (where
    the cache holds a layer's experts, alone computes them in the next layer's graph)."""
    monkeypatch.setattr(ggml_runner, "CHUNK", 5)
    with moestream.load(str(tiny_dir(arch)), cache=cache, trunk="ggml", parallel=4) as engine:
        runner = engine.runner
        assert runner.lockstep() and runner.experts.resident_slots() is None
        alone = [_alone(runner, p) for p in PROMPTS]
        before = engine.counters().misses
        tokens, seen = _side_by_side(runner, PROMPTS)
        assert engine.counters().misses > before  # experts were read during the rounds
    for (want_tokens, want), got_tokens, got in zip(alone, tokens, seen):
        assert got_tokens == want_tokens and torch.equal(got, want), (arch, (got - want).abs().max().item())


def test_side_by_side_steps_read_a_layers_experts_once_for_all(tiny_dir):
    """A cache of one layer's experts (8 slots, 2 layers of 8, 4 routed a token): three prompts fed one
    after the other read a layer's experts again for each (the other layer's evicted them in between);
    side by side, the experts a layer reads for the first are hits for the next two: each at most once."""
    path = str(tiny_dir("qwen3_moe", top_k=4))
    prompts = [[5, 17, 33, 2, 99, 41, 7], [250, 3, 12, 80, 8, 9], [9, 150, 77, 31, 200, 6]]
    misses = {}
    for way in ("in turn", "side by side"):
        with moestream.load(path, cache="300KiB", trunk="ggml", parallel=3) as engine:
            runner = engine.runner
            assert "8 slots of 36.0 KiB" in engine.mode_line() and runner.lockstep()
            before = engine.counters().misses
            if way == "in turn":
                got = [runner(p, kv)[0] for p, kv in zip(prompts, runner.seqs)]
            else:
                got = runner.together([], list(zip(prompts, runner.seqs)))
            misses[way] = engine.counters().misses - before
            logits = torch.stack(got)
        if way == "in turn":
            want = logits
    assert torch.equal(logits, want)
    assert misses["side by side"] <= 16 < misses["in turn"], misses


def test_lockstep_only_where_experts_stream_on_the_host(tiny_dir, tmp_path):
    """Every expert cached (one graph a step), prefetch (the routing followed a step at a time): no
    lockstep; a trace (told each step's rows) keeps it."""
    path = str(tiny_dir("qwen3_moe"))
    for options, want in (({"cache": "64MiB"}, False), ({"cache": "150KiB", "prefetch": "on"}, False)):
        with moestream.load(path, trunk="ggml", parallel=2, **options) as engine:
            assert engine.runner.lockstep() is want
    with moestream.load(path, cache="150KiB", trunk="ggml", parallel=2) as engine:
        runner = engine.runner
        engine.start_trace(tmp_path / "t.parquet", predict=False)
        assert runner.lockstep() and runner.experts.host_routing()
        engine.stop_trace()
        with pytest.raises(ValueError, match="each KV slot once"):
            runner.together([(runner.seqs[0], 3)], [([4, 5], runner.seqs[0])])
        with pytest.raises(ValueError, match="a chunk of 0 tokens"):
            runner.together([], [([], runner.seqs[1])])


def test_side_by_side_over_k_quant_experts_of_many_rows(tmp_path, monkeypatch):
    """A Q4_K model whose every expert takes every row (top-k = experts): prompt chunks of 9 tokens hand
    each expert 9 rows (ggml's tiled kernel, where the loaded ggml has one). Side by side through a few
    slots (every layer by the schedule) against alone with every expert cached (the step one graph, the
    experts in it): the same bits."""
    from tiny_gguf import q4k_all_routed

    path = str(q4k_all_routed(tmp_path))
    monkeypatch.setattr(ggml_runner, "CHUNK", 9)
    prompts = [[5 + i, 17 + 3 * i, 33, 2, 99, 41, 7, 250, 3, 12, 80, 8, 9][: 13 - i] for i in range(3)]
    with torch.inference_mode(), moestream.load(path, cache="64MiB", trunk="ggml", parallel=3) as engine:
        assert engine.runner.experts.resident_slots() is not None
        alone = [_alone(engine.runner, p) for p in prompts]
    with torch.inference_mode(), moestream.load(path, cache="600KiB", trunk="ggml", parallel=3) as engine:
        assert engine.runner.lockstep()
        tokens, seen = _side_by_side(engine.runner, prompts)
        assert engine.counters().misses > 8  # 8: the first read of each layer's 4
    for (want_tokens, want), got_tokens, got in zip(alone, tokens, seen):
        assert got_tokens == want_tokens and torch.equal(got, want), (got - want).abs().max().item()


def test_a_failure_in_a_round_side_by_side_leaves_the_runner_usable(tiny_dir, monkeypatch):
    """An expert read that fails in the middle of a round side by side (layer 1 of its second step):
    the round raises it and nothing stays pinned or half-counted (no sequence's tokens advance); the same
    round again gives every sequence its logits alone."""
    path = str(tiny_dir("qwen3_moe"))
    with torch.inference_mode(), moestream.load(path, cache="150KiB", trunk="ggml", parallel=3) as engine:
        runner = engine.runner
        alone = [runner(p, None)[0] for p in PROMPTS[:3]]
        compute, calls = runner.experts.compute, []

        def failing(layer, *args, **kwargs):
            calls.append(layer)
            if len(calls) == 4:
                raise OSError("the disk said no")
            return compute(layer, *args, **kwargs)

        monkeypatch.setattr(runner.experts, "compute", failing)
        for kv in runner.seqs[:3]:
            kv.tokens = 0
        chunks = list(zip(PROMPTS[:3], runner.seqs))
        with pytest.raises(OSError, match="the disk said no"):
            runner.together([], chunks)
        assert calls == [0, 0, 0, 1]  # layer 0 of each step, then layer 1 of the first
        assert [kv.tokens for kv in runner.seqs[:3]] == [0, 0, 0]
        assert all(state.pins == 0 for state in runner.experts._runtime.cache._states.values())
        got = runner.together([], chunks)
    assert all(torch.equal(g, a) for g, a in zip(got, alone))

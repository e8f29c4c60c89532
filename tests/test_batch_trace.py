"""Router traces of several requests at once: the engine records each row's request in a batched step,
and `moestream simulate --parallel N` regroups any trace's forwards as N requests running at once.

Oracles: the rounds worked out by hand on a small trace; a trace recorded with parallel=2 holds, for
every (request, token, layer), the experts the same request routes to recorded alone (the batched step
gives each row its bits alone), and steps holding both requests' rows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from batch_helpers import arrive_together

import moestream
from moestream.cli import main
from moestream.engine.batch import run_all
from moestream.trace import TraceHeader, TraceWriter, read_trace
from moestream.trace.batched import batch_steps
from moestream.trace.replay import build_replay
from moestream.units import MiB


def _three_requests(tmp_path: Path, predict: bool = False) -> Path:
    """Requests a, b, c one after another: a 2-token prompt, then 2 decoded tokens each, 2 layers x 4
    experts, top-2 (a's decode tokens route to experts 0, 1; b's to 2, 3; c's to 0, 3). `predict`: each
    layer-0 row guesses its layer 1's experts (the stale gate), scored 0.9."""
    path = tmp_path / ("three-predicted.parquet" if predict else "three.parquet")
    routes = {"a": [0, 1], "b": [2, 3], "c": [0, 3]}
    step = 0

    def guess(rows):
        return dict(pred_experts=rows, pred_scores=[[0.9, 0.9]] * len(rows)) if predict else {}

    with TraceWriter(path, TraceHeader("t", 2, 4, 2, expert_bytes=MiB)) as w:
        for name, experts in routes.items():
            for layer in (0, 1):
                rows = [[0, 1], [2, 3]]
                more = guess(rows) if layer == 0 else {}
                w.append_forward(name, [0, 1], "prefill", layer, rows, [[0.5, 0.5]] * 2, step=step, **more)
            step += 1
            for token in (2, 3):
                for layer in (0, 1):
                    more = {k: v[0] for k, v in guess([experts]).items()} if layer == 0 else {}
                    w.append(name, token, "decode", layer, experts, [0.5, 0.5], step=step, **more)
                step += 1
    return path


def _steps(trace) -> dict[tuple[str, int], int]:
    return {
        (trace.request_names[r], int(t)): int(s)
        for r, t, s, lay in zip(trace.request, trace.token, trace.step, trace.layer)
        if lay == 0
    }


def test_rounds_of_two_slots_worked_out_by_hand(tmp_path):
    trace = read_trace(_three_requests(tmp_path))
    got = _steps(batch_steps(trace, 2))
    # round 0: a's and b's prompts (4 tokens: one chunk holds both), a forward each; 1, 2: a and b decode
    # (they end: c takes a slot); 3: c's prompt; 4, 5: c decodes
    regrouped = batch_steps(trace, 2)
    assert got == {
        ("a", 0): 0, ("a", 1): 0, ("b", 0): 1, ("b", 1): 1, ("a", 2): 2, ("b", 2): 2,
        ("a", 3): 3, ("b", 3): 3, ("c", 0): 4, ("c", 1): 4, ("c", 2): 5, ("c", 3): 6,
    }  # fmt: skip
    assert sorted(set(zip(regrouped.step.tolist(), regrouped.round.tolist()))) == [
        (0, 0),
        (1, 0),
        (2, 1),
        (3, 2),
        (4, 3),
        (5, 4),
        (6, 5),
    ]
    # a chunk of 3 tokens holds a's prompt, not b's too: b's waits for the next round, beside a's decode
    assert _steps(batch_steps(trace, 2, chunk=3))[("b", 0)] == 2
    alone = _steps(batch_steps(trace, 1))
    assert alone == _steps(trace)  # one slot: the order recorded
    # one decode forward of a and b: the union of their experts, read once
    replay = build_replay(batch_steps(trace, 2))
    assert [(0, 0), (0, 1), (0, 2), (0, 3)] in replay.keys
    with pytest.raises(ValueError, match="--parallel must be at least 1, got 0"):
        batch_steps(trace, 0)


def test_a_rounds_forwards_side_by_side_read_a_layers_experts_once(tmp_path):
    """The replay of a regrouped trace in the engine's side-by-side order: round 0's two prompt forwards
    layer by layer (a's layer 0, b's layer 0, a's layer 1, b's layer 1), so that under a budget of one
    layer's experts (4 slots of 2 layers x 4) b's prompt hits what a's read: 8 misses for the two prompts
    (and 8 for c's, alone in its round), against 16 with the forwards one after the other (what the
    engine does with prefetch or a GPU tier)."""
    from moestream.engine import ggml_runner
    from moestream.trace import batched
    from moestream.trace.simulator import simulate

    assert batched.CHUNK == ggml_runner.CHUNK  # the engine's round on the host
    regrouped = batch_steps(read_trace(_three_requests(tmp_path)), 2)
    assert build_replay(regrouped, side_by_side=True).layer[:4] == [0, 0, 1, 1]
    assert build_replay(regrouped).layer[:4] == [0, 1, 0, 1]

    def prompt_misses(trace, policy: str = "lru") -> int:
        records = simulate(trace, [policy], [4 * MiB])[0]
        return next(r["misses"] for r in records if r["phase"] == "prefill" and r["scope"] == "all")

    assert prompt_misses(regrouped) == 8 + 8
    assert prompt_misses(dataclasses.replace(regrouped, round=None)) == 16 + 8


def test_prefetching_policies_replay_a_rounds_forwards_one_after_the_other(tmp_path):
    """Policies with and without prefetch in one simulation of a regrouped trace with predictions: each
    replayed as the engine runs it (lru side by side, lru-prefetch one after the other)."""
    from moestream.trace.simulator import simulate

    regrouped = batch_steps(read_trace(_three_requests(tmp_path, predict=True)), 2)
    apart = dataclasses.replace(regrouped, round=None)

    def records(trace, policies):
        return {
            (r["policy"], r["phase"]): (r["misses"], r["bytes_read"])
            for r in simulate(trace, policies, [4 * MiB])[0]
            if r["scope"] == "all"
        }

    both = records(regrouped, ["lru", "lru-prefetch"])
    assert both[("lru", "prefill")][0] == 8 + 8
    assert {k: v for k, v in both.items() if k[0] == "lru"} == records(regrouped, ["lru"])
    prefetching = {k: v for k, v in both.items() if k[0] == "lru-prefetch"}
    assert prefetching == records(apart, ["lru-prefetch"])
    # its prompts' reads, prefetches included: a's and b's each read whole, as one after the other
    assert both[("lru-prefetch", "prefill")][1] == 24 * MiB and both[("lru", "prefill")][1] == 16 * MiB


def test_simulate_parallel_on_the_command_line(tmp_path, capsys):
    path = str(_three_requests(tmp_path))
    assert main(["simulate", path, "--budgets", "4MiB", "--policy", "lru", "-np", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert "forwards regrouped as 2 requests at once (--parallel 2)" in out.err
    assert main(["simulate", path, "--budgets", "4MiB", "--parallel", "0"]) == 2
    assert "--parallel must be at least 1, got 0" in capsys.readouterr().err


def _jobs(engine, prompts: list[list[int]], tokens: int) -> list:
    """A generation of `tokens` greedy tokens for each prompt, request ids r0, r1, ..."""
    return [
        lambda i=i, p=p: engine.generate(p, max_tokens=tokens, ignore_eos=True, request_id=f"r{i}")
        for i, p in enumerate(prompts)
    ]


def _record(path: str, out: Path, parallel: int, prompts: list[list[int]], together: bool = False) -> int:
    """A trace of `prompts` run `parallel` at a time (`together`: their requests take their slots
    together, so one round feeds their prompts); the rounds run side by side."""
    with moestream.load(path, cache="150KiB", trunk="ggml", parallel=parallel) as engine:
        if together:
            arrive_together(engine, len(prompts))
        engine.start_trace(out, predict=False)
        run_all(_jobs(engine, prompts, 6), parallel)
        engine.stop_trace()
        return engine.batch.together_rounds if engine.batch is not None else 0


def _rows(trace) -> list[tuple]:
    """Every row as (request, token, layer, experts), sorted."""
    names = trace.request_names
    return sorted(
        (names[r], int(t), int(lay), tuple(e.tolist()))
        for r, t, lay, e in zip(trace.request, trace.token, trace.layer, trace.experts)
    )


def test_a_trace_of_a_batch_says_which_request_each_row_is(tiny_dir, tmp_path):
    path = str(tiny_dir("qwen3_moe"))
    prompts = [[5, 17, 33, 2], [250, 3, 12, 80, 9, 9]]
    _record(path, tmp_path / "alone.parquet", 1, prompts)
    _record(path, tmp_path / "batch.parquet", 2, prompts)
    alone, batch = read_trace(tmp_path / "alone.parquet"), read_trace(tmp_path / "batch.parquet")
    assert _rows(batch) == _rows(alone)
    shared = [s for s in np.unique(batch.step) if len(np.unique(batch.request[batch.step == s])) == 2]
    assert shared  # decode steps of both requests
    decode = batch.phase[np.isin(batch.step, shared)]
    assert (decode == 1).all()


def test_a_trace_of_rounds_side_by_side_gives_each_step_its_own_rows(tiny_dir, tmp_path):
    """Three requests that take their slots together, experts streamed: their prompts are fed in one round
    side by side, the recorder told before each step's layer whose rows come. Every row is the one
    recorded alone, and each prompt forward's step holds its own request's rows, all layers of it."""
    path = str(tiny_dir("qwen3_moe"))
    prompts = [[5, 17, 33, 2], [250, 3, 12, 80, 9, 9], [64, 7, 9]]
    _record(path, tmp_path / "alone.parquet", 1, prompts)
    assert _record(path, tmp_path / "side.parquet", 3, prompts, together=True) >= 1
    alone, side = read_trace(tmp_path / "alone.parquet"), read_trace(tmp_path / "side.parquet")
    assert _rows(side) == _rows(alone)
    prefill = np.unique(side.step[side.phase == 0])
    assert len(prefill) == 3  # a forward each, in one round
    for s in prefill:
        mine = side.step == s
        (request,) = np.unique(side.request[mine])
        n = len(prompts[int(side.request_names[request][1:])])
        assert sorted(set(side.token[mine].tolist())) == list(range(n))
        assert len(np.unique(side.layer[mine])) == alone.header.n_layers


def test_a_traced_round_that_fails_midway_leaves_the_next_steps_numbers_free(tiny_dir, tmp_path):
    """A round side by side whose expert read fails at the second layer of its first step, after every
    step's first layer was recorded: the next request's forwards take step numbers after all of the
    round's, none shared with rows already written."""
    path = str(tiny_dir("qwen3_moe"))
    prompts = [[5, 17, 33, 2], [250, 3, 12, 80, 9, 9], [64, 7, 9]]
    with moestream.load(path, cache="150KiB", trunk="ggml", parallel=3) as engine:
        acquire = engine.batch.acquire
        arrive_together(engine, 3)
        compute, calls = engine.runner.experts.compute, []

        def failing(layer, *args, **kwargs):
            calls.append(layer)
            if len(calls) == 4:
                raise OSError("the disk said no")
            return compute(layer, *args, **kwargs)

        engine.runner.experts.compute = failing
        engine.start_trace(tmp_path / "t.parquet", predict=False)
        with pytest.raises(OSError, match="the disk said no"):
            run_all(_jobs(engine, prompts, 3), 3)
        assert calls == [0, 0, 0, 1] and engine.batch.together_rounds == 1
        engine.batch.acquire = acquire
        engine.generate([9, 8, 7], max_tokens=2, ignore_eos=True, request_id="after")
        engine.stop_trace()
    trace = read_trace(tmp_path / "t.parquet")
    after = trace.request == trace.request_names.index("after")
    assert len(np.unique(trace.request[~after])) == 3  # each failed step's first layer was written
    assert trace.step[after].min() > trace.step[~after].max()

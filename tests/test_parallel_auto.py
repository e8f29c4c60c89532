"""`--parallel auto` (serve's default): 4, 2 or 1 slots, chosen at load by the memory plan.

The rule as a pure function with given numbers; the plan's numbers for a real model (synth96) against
rooms of several sizes, given as `Room`s (as the auto budget's tests give them) with the libraries'
mapped files fixed, each room built from the plan's own parts so the expected choice is known; a load
of a tiny model with parallel="auto"; serve's argument.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from memory_limits import write_synth96
from test_bad_input import _cli

import moestream
from moestream.cli.serve import parallel_count
from moestream.engine import auto_budget
from moestream.engine.auto_budget import MARGIN_SHARE, SlotPlan, auto_parallel, choose_parallel, slot_plans
from moestream.engine.memory import Room
from moestream.engine.options import AUTO, EngineOptions
from moestream.errors import MoestreamError
from moestream.runtime.streaming import host_cache_bytes
from moestream.units import MiB

EVERY = 1000 * MiB


# --- the rule, with given numbers ------------------------------------------------------------------


def _plans(one: int | None, two: int | None, four: int | None) -> list[SlotPlan]:
    return [
        SlotPlan(4, 64 * MiB, 48 * MiB, cache=four),
        SlotPlan(2, 32 * MiB, 16 * MiB, cache=two),
        SlotPlan(1, 16 * MiB, 0, cache=one),
    ]


def test_every_expert_cached_with_one_slot_must_stay_cached():
    plan, words = choose_parallel(_plans(EVERY, EVERY, EVERY), EVERY, 512)
    assert plan.slots == 4 and words == "4 KV slots of 512 tokens (F16), 64.0 MiB; every expert still cached"
    # 4 slots would stream (even a little): 2 that keep every expert cached
    plan, words = choose_parallel(_plans(EVERY, EVERY, EVERY - 1), EVERY, 512)
    assert plan.slots == 2
    assert words.startswith("2 KV slots of 512 tokens (F16), 32.0 MiB; every expert still cached; 4 slots")
    plan, words = choose_parallel(_plans(EVERY, EVERY - MiB, EVERY - MiB), EVERY, 512)
    assert plan.slots == 1 and words.startswith("4 slots would leave the cache 999.0 MiB of every expert's")


def test_a_streaming_cache_keeps_at_least_seven_eighths():
    one = 800 * MiB
    assert choose_parallel(_plans(one, one - MiB, 700 * MiB), EVERY, 512)[0].slots == 4  # exactly 7/8
    plan, words = choose_parallel(_plans(one, 700 * MiB, 700 * MiB - 1), EVERY, 512)
    assert plan.slots == 2
    assert "the cache keeps 700.0 MiB of one slot's 800.0 MiB" in words
    assert "4 slots would leave the cache" in words and "(less than 7/8)" in words
    assert choose_parallel(_plans(one, 700 * MiB - 1, 600 * MiB), EVERY, 512)[0].slots == 1
    # no room for the smallest cache with more slots: one
    plan, words = choose_parallel(_plans(one, None, None), EVERY, 512)
    assert plan.slots == 1 and "2 slots would leave no room for the cache" in words


def test_an_explicit_cache_takes_the_slots_whose_plan_fits():
    plans = [SlotPlan(4, 64 * MiB, 48 * MiB, fits=False), SlotPlan(2, 32 * MiB, 16 * MiB), SlotPlan(1, 0, 0)]
    plan, words = choose_parallel(plans, None, 512)
    assert plan.slots == 2 and "they fit beside the cache given" in words
    assert "4 slots' 64.0 MiB KV cache would not fit" in words
    plans[1] = dataclasses.replace(plans[1], fits=False)
    assert choose_parallel(plans, None, 512)[0].slots == 1


# --- the plan's numbers at several memory sizes ----------------------------------------------------


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """synth96 loaded once (one slot): its description, as `auto_parallel` gets it at load."""
    path = write_synth96(tmp_path_factory.mktemp("npauto") / "m")
    with moestream.load(str(path), preload=False, threads=1) as engine:
        yield engine.loaded.description, engine.options


@pytest.fixture
def fixed_libraries(monkeypatch):
    """The libraries' mapped files fixed (a measurement that moves): the rooms below are exact."""
    monkeypatch.setattr(auto_budget, "mapped_file_bytes", lambda: 50 * MiB)


def _room(free: int, kept: int) -> Room:
    """The room that leaves `free` bytes for the cache after `kept` and the margin."""
    nbytes = (free + kept) * MARGIN_SHARE // (MARGIN_SHARE - 1)
    while nbytes - nbytes // MARGIN_SHARE - kept < free:
        nbytes += 1
    return Room(nbytes, f"MemAvailable is {nbytes} bytes")


def _auto(options: EngineOptions) -> EngineOptions:
    return dataclasses.replace(options, cache=AUTO, gpu_cache=AUTO, host_cache=AUTO)


def test_the_plan_at_several_memory_sizes_with_an_auto_cache(synth, fixed_libraries):
    model, options = synth
    options = _auto(options)
    plans, every = slot_plans(model, options, [Room(1 << 40, "MemAvailable is 1.0 TiB")])
    one, two, four = (next(p for p in plans if p.slots == n) for n in (1, 2, 4))
    # the extra slots: their KV cache (4 MiB a slot at 4096 tokens) and more graph buffers
    assert (one.kv, two.kv, four.kv) == (4 * MiB, 8 * MiB, 16 * MiB)
    assert four.extra > two.extra > 4 * MiB and two.kept - one.kept == two.extra
    assert 8 * two.extra < every < 8 * four.extra  # so a streaming cache allows 2 slots, never 4

    def chosen(free: int) -> tuple[int, str]:
        return auto_parallel(model, options, rooms=[_room(free, one.kept)])

    want = "4 KV slots of 4096 tokens (F16), 16.0 MiB; every expert still cached"
    assert chosen(every + four.extra) == (4, want)
    slots, words = chosen(every + four.extra - 1)  # one slot holds every expert; 4 would stream
    assert slots == 2
    assert words.startswith("2 KV slots of 4096 tokens (F16), 8.0 MiB; every expert still cached")
    assert "; 4 slots would leave the cache " in words
    assert chosen(every + two.extra - 1)[0] == 1
    # streaming with one slot: 2 slots while they keep 7/8 of its bytes
    slots, words = chosen(every // 2)
    assert slots == 2 and "the cache keeps " in words
    assert chosen(8 * two.extra + 8 * MiB)[0] == 2  # 8 MiB: past the rounding to whole slots
    slots, words = chosen(8 * two.extra - 8 * MiB)
    assert slots == 1 and "2 slots would leave the cache " in words and "(less than 7/8)" in words
    # room for the smallest cache with one slot only
    slots, words = chosen(2 * MiB)
    assert slots == 1 and "2 slots would leave no room for the cache" in words


def test_the_plan_with_an_explicit_cache(synth, fixed_libraries):
    model, options = synth
    options = dataclasses.replace(options, cache=4 * MiB, gpu_cache=4 * MiB, host_cache=0)
    plans, every = slot_plans(model, options, [Room(1 << 40, "MemAvailable is 1.0 TiB")])
    assert every is None
    one, two, four = (next(p for p in plans if p.slots == n) for n in (1, 2, 4))
    cache = host_cache_bytes(model.emap, options.stream_config(), model.top_k, model.device)
    assert auto_parallel(model, options, rooms=[_room(cache + four.extra, one.kept)])[0] == 4
    slots, words = auto_parallel(model, options, rooms=[_room(cache + four.extra - 1, one.kept)])
    assert slots == 2 and "they fit beside the cache given" in words
    assert auto_parallel(model, options, rooms=[_room(cache + two.extra - 1, one.kept)])[0] == 1


def test_a_runner_that_cannot_batch_gets_one_slot_and_says_why(synth):
    model, options = synth
    eager = dataclasses.replace(model, spec=None)
    assert auto_parallel(eager, dataclasses.replace(options, trunk="eager")) == (
        1,
        "this run's trunk (--trunk eager) runs one request at a time",
    )


# --- a load, and the options ------------------------------------------------------------------------


def test_a_load_with_parallel_auto_batches_the_slots_it_chose(tiny_dir):
    path = str(tiny_dir("qwen3_moe"))
    with moestream.load(path, parallel="auto", threads=1) as engine:  # memory to spare: 4
        assert engine.options.parallel == 4 and engine.batch.slots == 4 and len(engine.runner.seqs) == 4
        line = engine.mode_line()
        assert line.endswith(
            "parallel 4 (auto: 4 KV slots of 256 tokens (F16), 256.0 KiB; every expert still cached)"
        )
        assert "KV cache F16 of 256 positions in each of 4 slots (--parallel 4)" in line
        prompts = ["hello there", "the sky is"]
        alone = [engine.generate(p, max_tokens=4, ignore_eos=True).tokens for p in prompts]
        gens = engine.generate_batch(prompts, max_tokens=4, ignore_eos=True)  # in slots of the batch
        assert [g.tokens for g in gens] == alone and engine.batch.decode_rows >= 8
    with moestream.load(path, parallel="auto", trunk="eager") as engine:
        assert engine.options.parallel == 1 and engine.batch is None
        assert engine.mode_line().endswith(
            "parallel 1 (auto: this run's trunk (--trunk eager) runs one request at a time)"
        )
    with moestream.load(path) as engine:  # the API's default: one, in the words of before
        assert engine.options.parallel == 1 and engine.mode_line().endswith("parallel 1")


def test_parallel_values():
    assert EngineOptions().parallel == 1
    assert EngineOptions(parallel=" Auto ").parallel == AUTO and EngineOptions(parallel="3").parallel == 3
    with pytest.raises(ValueError, match="--parallel takes auto or a number of slots from 1 to 64, got 'x'"):
        EngineOptions(parallel="x")
    with pytest.raises(ValueError, match="--parallel must be between 1 and 64, got 65"):
        EngineOptions(parallel=65)
    with pytest.raises(MoestreamError, match="--parallel takes auto or a number of slots"):
        moestream.load("/nonexistent", parallel="many")


def test_serve_takes_auto_by_default_an_integer_and_refuses_junk(capsys, tmp_path: Path):
    from moestream.cli import build_parser

    argv = ["serve", str(tmp_path / "m")]
    assert build_parser(argv).parse_args(argv).parallel == AUTO
    assert build_parser(argv).parse_args([*argv, "-np", "3"]).parallel == 3
    assert build_parser(argv).parse_args([*argv, "--parallel", "auto"]).parallel == AUTO
    assert parallel_count("AUTO") == AUTO
    for junk in ("many", "0", "2.5"):
        code, _, err = _cli(capsys, "serve", tmp_path / "never-read", "-np", junk)
        assert code == 2
        assert err.strip().splitlines()[-1].startswith("moestream serve: error: argument -np/--parallel: ")
    code, _, err = _cli(capsys, "serve", tmp_path / "never-read", "-np", "many")
    assert "--parallel takes auto or a number of slots from 1 to 64, got 'many'" in err

"""`moestream plan` on a tiny checkpoint: MiB/token equals the simulator's, predicted time follows the formula
from the measured parts, the plot is a PNG, user errors are one sentence. No timing asserts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from moestream.cache.slots import plan_parts, slot_bytes
from moestream.cli import main
from moestream.model.arch import arch_for, num_experts
from moestream.store.source import open_source
from moestream.trace.jsonl import write_jsonl
from moestream.trace.reader import read_trace
from moestream.trace.simulator import simulate
from moestream.trace.synthetic import random_trace
from moestream.units import MiB

BUDGETS = [
    96 << 10,
    160 << 10,
    320 << 10,
]  # 2, 4 and 8 slots of 36 KiB (the tiny model's 16 experts: 576 KiB)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model(tiny_dir) -> Path:
    return tiny_dir("qwen3_moe")  # 2 MoE layers x 8 experts, top-2


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "trace.jsonl"
    write_jsonl(
        random_trace(n_layers=2, n_experts=8, top_k=2, n_requests=2, prompt_len=5, decode_len=20), path
    )
    return path


def simulated_mib_per_token(model: Path, trace_path: Path, budgets: list[int]) -> dict[int, float]:
    """The simulator run directly, with the model's sizes worked out here: each expert costs the aligned
    bytes the cache's reads ask for, a slot what the cache carves for it."""
    source = open_source(str(model))
    config = source.config()
    emap = source.expert_map(arch_for(config).family, num_experts(config))
    read = max(
        sum(p.length for ps in plan_parts(emap.kinds, parts).values() for p in ps)
        for parts in emap.units.values()
    )
    slot = max(slot_bytes(parts) for parts in emap.units.values())
    trace = read_trace(trace_path)
    n = config.num_hidden_layers
    trace = dataclasses.replace(
        trace,
        header=dataclasses.replace(trace.header, n_layers=n, expert_bytes=[read] * n, slot_bytes=[slot] * n),
    )
    records, _, _ = simulate(trace, ["lru"], budgets)
    return {
        r["budget_bytes"]: r["mib_per_token"]
        for r in records
        if r["phase"] == "decode" and r["scope"] == "all"
    }


def plan_json(capsys: pytest.CaptureFixture, args: list[str]) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def check_formula(out: dict) -> None:
    cached, rate = out["compute_ms_per_token"], out["read_bytes_per_s"]
    streaming = out["streaming_compute_ms_per_token"] or cached
    for row in out["rows"]:
        compute = cached + (streaming - cached) * (1 - row["hit_rate"])
        read_ms = row["mib_per_token"] * MiB / rate * 1000
        assert row["compute_ms"] == pytest.approx(compute, rel=1e-12)
        assert row["read_ms"] == pytest.approx(read_ms, rel=1e-12)
        assert row["ms"] == pytest.approx(compute + read_ms, rel=1e-12)
        assert row["overlap_ms"] == pytest.approx(max(compute, read_ms), rel=1e-12)
        assert row["tok_s"] == pytest.approx(1000 / (compute + read_ms), rel=1e-12)


def test_given_trace_bytes_equal_the_simulator_and_time_follows_the_formula(
    model: Path, trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    png = tmp_path / "plan.png"
    budgets = ",".join(f"{b >> 10}KiB" for b in BUDGETS)
    out = plan_json(
        capsys,
        [
            str(model),
            "--trace",
            str(trace_file),
            "--budgets",
            budgets,
            "--max-tokens",
            "3",
            "--read-seconds",
            "0.2",
        ],
    )
    assert (
        out["read_rate_measured"] is True and out["read_bytes_per_s"] > 0 and out["ceiling_bytes_per_s"] > 0
    )
    engine = out["engine_read"]  # the rate predicted with: bytes over the time waited for them
    waited = engine["read_wait_s"] if engine["read_wait_s"] > 0.01 * engine["seconds"] else engine["seconds"]
    assert engine["budget"] == 72 << 10 and out["read_bytes_per_s"] == engine["nbytes"] / waited
    streaming = 1000 * (engine["seconds"] - engine["read_wait_s"]) / engine["tokens"]
    assert out["streaming_compute_ms_per_token"] == pytest.approx(streaming, rel=1e-12)
    # two built-in prompts, 2 tokens decoded on each in the timed pass
    assert out["compute_ms_per_token"] > 0 and out["compute_tokens"] == 2 * 2
    rows = {r["budget_bytes"]: r for r in out["rows"]}
    all_experts = 16 * (36 << 10)
    assert sorted(rows) == [*BUDGETS, all_experts] and rows[all_experts]["label"] == "auto = all experts"
    expected = simulated_mib_per_token(model, trace_file, [*BUDGETS, all_experts])
    assert out["auto"] == all_experts  # the tiny model fits: the auto budget holds every expert
    assert {b: r["mib_per_token"] for b, r in rows.items()} == expected
    assert expected[BUDGETS[0]] > expected[BUDGETS[-1]]  # the budgets differ where it matters
    check_formula(out)
    # the same with the plot, as a table, and a given read rate in the formula
    table = [str(model), "--trace", str(trace_file), "--budgets", budgets, "-n", "3", "--read-rate", "1GiB"]
    assert main(["plan", *table, "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert (
        "MiB/token" in captured.out
        and "all experts" in captured.out
        and "auto cache: every expert" in captured.out
    )
    assert "SYNTHETIC ROUTING" in captured.out  # the random trace is marked synthetic
    assert png.read_bytes()[:8] == PNG


def test_recorded_trace_is_kept_and_replayed(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    saved = tmp_path / "recorded.parquet"
    out = plan_json(
        capsys,
        [
            str(model),
            "-p",
            "def f(x):",
            "-p",
            "hello there",
            "-n",
            "6",
            "--budgets",
            "80KiB,200KiB",
            "--save-trace",
            str(saved),
            "--read-rate",
            "2GiB",
        ],
    )
    trace = read_trace(saved)
    assert (
        trace.request_names and len(trace.request_names) == 2 and int((trace.phase == 1).sum()) == 2 * 5 * 2
    )
    rows = {r["budget_bytes"]: r["mib_per_token"] for r in out["rows"]}
    assert rows == simulated_mib_per_token(model, saved, sorted(rows))
    assert out["read_bytes_per_s"] == 2 << 30 and out["read_rate_measured"] is False
    check_formula(out)


def _error(capsys: pytest.CaptureFixture, args: list[str]) -> str:
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moestream: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_user_errors_are_one_sentence(
    model: Path, trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "is empty" in _error(capsys, [str(model), "--trace", str(empty)])
    whole = read_trace(trace_file)
    keep = whole.phase == 0
    prefill_only = dataclasses.replace(
        whole,
        **{
            f: getattr(whole, f)[keep]
            for f in ("request", "token", "phase", "layer", "step", "experts", "weights")
        },
    )
    path = tmp_path / "prefill.jsonl"
    write_jsonl(prefill_only, path)
    assert "holds no decode tokens" in _error(capsys, [str(model), "--trace", str(path)])
    err = _error(capsys, [str(model), "--trace", str(trace_file), "--budgets", "64KiB,1MiB"])
    assert "64.0 KiB is below this model's minimum of 72.0 KiB" in err
    other = tmp_path / "other.jsonl"
    write_jsonl(random_trace(n_layers=2, n_experts=16, top_k=2, n_requests=1), other)
    assert "top-2 of 16 experts" in _error(capsys, [str(model), "--trace", str(other)])
    assert "must end in .png" in _error(capsys, [str(model), "--plot", str(tmp_path / "p.jpg")])
    assert "--max-tokens must be at least 2" in _error(capsys, [str(model), "-n", "1"])
    assert "with --read-rate it is not" in _error(
        capsys, [str(model), "--read-rate", "1GiB", "--read-seconds", "1"]
    )
    assert np.all(whole.phase[keep] == 0)

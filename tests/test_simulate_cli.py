"""`moestream simulate` / `predict-eval` end to end: JSON fields, tables, plot, user errors, no torch, real
traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from shared_data import MIXTRAL, MIXTRAL_EXPERT, QWEN, QWEN_EXPERT, needs_traces

from moestream.cli import main
from moestream.trace.jsonl import write_jsonl
from moestream.trace.synthetic import random_trace


@pytest.fixture(scope="module")
def synthetic_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("t") / "syn.jsonl"
    write_jsonl(random_trace(n_layers=4, n_experts=16, top_k=2, n_requests=2, predictions=True), path)
    return path


def test_json_records_have_the_promised_fields(synthetic_jsonl: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", str(synthetic_jsonl), "--budgets", "4MiB,16MiB", "--json"]) == 0
    out = capsys.readouterr()
    records = json.loads(out.out)
    assert {r["policy"] for r in records} == {
        "lru",
        "lfu",
        "predictive",
        "partitioned-lru",
        "static",
        "opt",
        "lru-prefetch",
        "predictive-prefetch",
    }
    assert {r["budget_bytes"] for r in records} == {4 << 20, 16 << 20}
    assert {r["phase"] for r in records} == {"prefill", "decode"}
    for r in records:
        assert {"policy", "budget_bytes", "phase", "hit_rate", "mib_per_token", "hits", "misses"} <= r.keys()
        assert r["synthetic"] is True
    assert "note: UPPER BOUND" in out.err  # notes go to stderr, so the JSON stays parseable


def test_table_plot_and_upper_bound_label(
    synthetic_jsonl: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    png = tmp_path / "curves.png"
    assert (
        main(
            [
                "simulate",
                str(synthetic_jsonl),
                "--budgets",
                "4MiB,8MiB",
                "--policy",
                "lru",
                "belady",
                "prefetch",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "decode, whole trace: MiB read per token (hit rate)" in text and "UPPER BOUND" in text
    assert "lru-prefetch" in text and "opt" in text and "lfu" not in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["predict-eval", str(synthetic_jsonl)]) == 0
    text = capsys.readouterr().out
    assert "stale gate L+1, top-2 (k)" in text and "(upper bound: synthetic)" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["simulate", "/nonexistent/t.parquet"], "does not exist"),
        (["simulate", "{syn}", "--budgets", "2 bananas"], "bad budget"),
        (["simulate", "{syn}", "--policy", "fifo"], "unknown policy 'fifo'"),
        (["simulate", "{syn}", "--budgets", "1KiB"], "holds no expert slot"),
        (["simulate", "{syn}", "--gpu-tier", "lots"], "bad --gpu-tier"),
        (["simulate", "{syn}", "--gpu-tier", "1MiB"], "fewer than the 2 a token routes to"),
        (["simulate", "{syn}", "--gpu-tier", "8MiB", "--policy", "opt"], "--gpu-tier replays lru or lfu"),
        (["predict-eval", "/nonexistent/t.jsonl"], "does not exist"),
    ],
)
def test_user_errors_exit_2_with_one_sentence(
    synthetic_jsonl: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    assert main([a.format(syn=synthetic_jsonl) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moestream: error:") and message in err and "Traceback" not in err


def test_simulate_never_imports_torch(synthetic_jsonl: Path) -> None:
    code = (
        "import sys; from moestream.cli import main; "
        f"rc = main(['simulate', {str(synthetic_jsonl)!r}, '--budgets', '8MiB', '--json']); "
        "rc |= main(['predict-eval', " + repr(str(synthetic_jsonl)) + "]); "
        "assert rc == 0 and 'torch' not in sys.modules and 'transformers' not in sys.modules, "
        "sorted(sys.modules)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert run.returncode == 0, run.stderr[-2000:]


@needs_traces
def test_real_traces_without_sizes_ask_for_unit_bytes(capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", str(MIXTRAL)]) == 2
    assert "--unit-bytes" in capsys.readouterr().err


@needs_traces
def test_real_mixtral_curves(capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "simulate",
                str(MIXTRAL),
                "--unit-bytes",
                str(MIXTRAL_EXPERT),
                "--budgets",
                "16GiB,64GiB",
                "--json",
            ]
        )
        == 0
    )
    records = json.loads(capsys.readouterr().out)
    dec = {
        (r["policy"], r["budget_bytes"] >> 30): r
        for r in records
        if r["phase"] == "decode" and r["scope"] == "all"
    }
    # 16 GiB = 48 slots < the 64 keys one token cycles through: LRU evicts each key just before its reuse
    assert dec[("lru", 16)]["hit_rate"] == 0.0
    assert dec[("opt", 16)]["hit_rate"] > 0.4 and dec[("lru", 64)]["hit_rate"] > 0.7
    assert all(dec[("opt", b)]["misses"] <= dec[(p, b)]["misses"] for p in ("lru", "lfu") for b in (16, 64))


@needs_traces
def test_real_qwen_merge_runs(capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "simulate",
                *map(str, QWEN),
                "--unit-bytes",
                str(QWEN_EXPERT),
                "--budgets",
                "1GiB",
                "--policy",
                "lru",
                "opt",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "replayed as one 5-layer model" in text and "decode, whole trace" in text
    assert main(["predict-eval", str(MIXTRAL)]) == 0
    assert "previous token, same layer" in capsys.readouterr().out

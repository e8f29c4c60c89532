"""`moestream bench` against a live tiny `moestream serve`: texts equal the engine's own greedy output,
timings are the server's, reports and plots are written, a baseline diff finds a planted difference,
and `--model` starts its own server (with a lossy top-k labelled as such)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_server_harness import KEY, shared_server

import moestream
from moestream.bench.harness import BenchConfig, run_bench
from moestream.bench.system import device_for_path
from moestream.cli import build_parser, main
from moestream.cli.bench import engine_argv

PROMPTS = [
    {"prompt": "The quick brown fox jumps", "lang": "en"},
    {"prompt": "안녕하세요. 오늘은", "lang": "ko"},
    {"prompt": "Mixture of experts models route", "lang": "en"},
]
TOKENS = 8


@pytest.fixture(scope="module")
def first_run(tiny_dir, tmp_path_factory):
    server = shared_server(tiny_dir("qwen3_moe"))
    server.wait_idle()
    root = tmp_path_factory.mktemp("bench")
    (root / "prompts.json").write_text(json.dumps(PROMPTS, ensure_ascii=False))
    config = BenchConfig(
        out=root / "run1",
        prompts=str(root / "prompts.json"),
        max_tokens=TOKENS,
        target=server.url + "/v1",
        api_key=KEY,
        disk_of=str(server.path),
        label="first",
    )
    return server, root, run_bench(config)


def test_texts_and_timings_come_from_the_server(first_run):
    server, root, results = first_run
    with moestream.load(str(server.path), cache="1MiB", threads=1) as engine:
        expected = [engine.generate(p["prompt"], max_tokens=TOKENS, ignore_eos=True) for p in PROMPTS]
    counted = device_for_path(server.path) is not None
    for r, gen, p in zip(results["requests"], expected, PROMPTS):
        assert (r["prompt"], r["lang"], r["text"]) == (p["prompt"], p["lang"], gen.text)
        assert (r["prompt_n"], r["predicted_n"]) == (gen.prompt_tokens, TOKENS)
        assert r["decode_tok_s"] == pytest.approx(1000 * TOKENS / r["predicted_ms"], rel=1e-6)
        assert r["ms_per_token"] == pytest.approx(r["predicted_ms"] / (TOKENS - 1))
        assert r["moe"]["hits"] + r["moe"]["misses"] > 0
        assert (r["device_bytes"] is not None) == counted and (not counted or r["device_bytes"] >= 0)
    assert results["server"] == "moestream" and not results["lossy"]
    s = results["summary"]
    assert s["decode_tok_s_mean"] == pytest.approx(sum(r["decode_tok_s"] for r in results["requests"]) / 3)
    assert s["generated_tokens"] == 3 * TOKENS
    assert json.loads((root / "run1/results.json").read_text(encoding="utf-8")) == results
    report = (root / "run1/report.md").read_text(encoding="utf-8")
    assert report.count("\n| ") == 4 and "decode " in report  # header + 3 requests
    assert (root / "run1/decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_baseline_diff_finds_a_planted_difference(first_run):
    server, root, first = first_run
    planted = json.loads(json.dumps(first))
    text = planted["requests"][1]["text"]
    planted["requests"][1]["text"] = text[:2] + ("X" if text[2:3] != "X" else "Y") + text[3:]
    (root / "planted.json").write_text(json.dumps(planted))
    config = BenchConfig(
        out=root / "run2",
        prompts=str(root / "prompts.json"),
        max_tokens=TOKENS,
        target=server.url,
        api_key=KEY,
        baseline=str(root / "planted.json"),
        plots=False,
    )
    baseline = run_bench(config)["baseline"]
    assert (baseline["identical"], baseline["of"]) == (2, 3)
    assert [d["first_diff"] for d in baseline["diffs"]] == [None, 2, None]
    assert "| no (char 2) |" in (root / "run2/report.md").read_text(encoding="utf-8")


def test_model_starts_its_own_server_and_labels_lossy_runs(first_run, tiny_dir, tmp_path):
    _, root, _ = first_run
    out = tmp_path / "k1"
    argv = [
        sys.executable,
        "-m",
        "moestream",
        "bench",
        "--model",
        str(tiny_dir("qwen3_moe")),
        "--prompts",
        str(root / "prompts.json"),
        "--max-tokens",
        "4",
        "--out",
        str(out),
        "--cache",
        "1MiB",
        "--threads",
        "1",
        "--experts-per-token",
        "1",
        "--fit-with",
        str(root / "run1"),
        "--label",
        "k1",
        "--no-plots",
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert "LOSSY: 1 experts per token" in results["mode_line"] and results["lossy"]
    assert "LOSSY run" in proc.stdout and "--experts-per-token" in results["settings"]["server_argv"]
    assert results["fit_runs"] == ["k1", "first"]
    assert [r["predicted_n"] for r in results["requests"]] == [4, 4, 4]
    assert (out / "server.log").exists()


def test_engine_options_travel_to_the_server_and_not_to_a_target(capsys, tmp_path):
    args = build_parser(["bench"]).parse_args(
        ["bench", "--model", "m", "--out", "d", "--cache", "1MiB", "--no-mlock", "--experts-per-token", "2"]
    )
    assert engine_argv(args) == ["--cache", "1MiB", "--no-mlock", "--experts-per-token", "2"]
    assert main(["bench", "--target", "http://127.0.0.1:9", "--cache", "1MiB", "--out", str(tmp_path)]) == 2
    assert "apply to --model only" in capsys.readouterr().err

"""The engine's GPU clock floor, on a fake Jetson sysfs tree: raised while generating, restored on close."""

from __future__ import annotations

from pathlib import Path

import moestream
from moestream.cli import main
from moestream.power.testing import make_fake_jetson


def _min_mhz(node: Path) -> int:
    return int(Path(node, "min_freq").read_text()) // 1_000_000


def test_floor_raised_during_generation_and_restored(tiny_dir, tmp_path):
    node = make_fake_jetson(tmp_path / "root", min_mhz=408)
    seen = []
    with moestream.load(
        str(tiny_dir("qwen3_moe")), cache="1MiB", gpu_floor="auto", sysfs_root=str(tmp_path / "root")
    ) as engine:
        assert "gpu floor auto" in engine.mode_line()
        for gen in engine.stream([5, 6, 7], max_tokens=4, ignore_eos=True):
            seen.append(_min_mhz(node))
        assert gen.stats.gpu_floor == "active" and "gpu floor active" in gen.stats.line()
    assert max(seen) == 1020  # the highest available frequency of the fake Orin Nano
    assert _min_mhz(node) == 408  # original value back after close


def test_no_jetson_means_floor_off(tiny_dir, capsys):
    assert main(["generate", str(tiny_dir("qwen3_moe")), "--prompt", "Hi", "--max-tokens", "2"]) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("moestream: warning:")]
    assert "| gpu floor off |" in err[0] and err[-1].endswith("gpu floor off")  # mode line, stats line


def test_explicit_mhz_without_jetson_is_one_clear_error(tiny_dir, capsys):
    assert main(["generate", str(tiny_dir("qwen3_moe")), "--prompt", "Hi", "--gpu-floor", "1020"]) == 2
    err = capsys.readouterr().err
    assert "needs a Jetson GPU devfreq node" in err and "Traceback" not in err

"""The engine's GPU floor on a fake Jetson sysfs tree, driven by a fake clock."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from moestream.cli._power_args import add_gpu_floor_argument
from moestream.errors import MoestreamError
from moestream.power.floor import EngineFloor, make_engine_floor, parse_floor_spec
from moestream.power.testing import make_fake_jetson, set_value

MHZ = 1_000_000


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def min_mhz(node: Path) -> int:
    # a plain file, unlike sysfs, can be read empty between the writer's truncate and write
    for _ in range(100):
        text = (node / "min_freq").read_text()
        if text.strip():
            return int(text) // MHZ
        time.sleep(0.001)
    raise AssertionError("min_freq stayed empty")


@pytest.fixture
def jetson(tmp_path: Path) -> Path:
    """Fake Orin Nano whose min_freq starts at 408 MHz, so "restored" and "idle" (306) differ."""
    return make_fake_jetson(tmp_path / "root", min_mhz=408)


def engine_floor(tmp_path: Path, clock: FakeClock, spec: str = "auto", **kw) -> EngineFloor:
    floor = make_engine_floor(
        spec,
        sysfs_root=str(tmp_path / "root"),
        state_dir=tmp_path / "state",
        clock=clock,
        background=False,
        handle_signals=False,
        **kw,
    )
    assert floor is not None
    return floor


def test_raised_on_first_call_held_in_flight_released_after_hold(
    tmp_path: Path, jetson: Path, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="moestream.power")
    clock = FakeClock()
    floor = engine_floor(tmp_path, clock)
    assert min_mhz(jetson) == 408 and not floor.was_active
    floor.begin()
    assert min_mhz(jetson) == 1020 and floor.raised and floor.was_active
    floor.begin()  # nested: a second thread or an inner forward
    floor.end()
    clock.now += 30.0  # a long call still in flight: no release, whatever the time
    assert floor.tick() is None and min_mhz(jetson) == 1020
    floor.end()
    clock.now += 0.99
    assert floor.tick() == pytest.approx(0.01) and min_mhz(jetson) == 1020
    clock.now += 0.01
    floor.tick()
    assert min_mhz(jetson) == 306 and not floor.raised and floor.was_active
    messages = [r.getMessage() for r in caplog.records]
    assert f"floor 1020 MHz (pid {os.getpid()} inference)" in messages
    assert "floor 306 MHz (idle)" in messages
    floor.close()
    assert min_mhz(jetson) == 408


def test_activity_between_calls_restarts_the_hold(tmp_path: Path, jetson: Path) -> None:
    clock = FakeClock()
    floor = engine_floor(tmp_path, clock, hold_s=1.0)
    with floor.activity():
        pass
    clock.now += 0.8
    with floor.activity():  # a new token within the hold time: stays up, hold starts over
        pass
    clock.now += 0.8
    floor.tick()
    assert min_mhz(jetson) == 1020
    clock.now += 0.2
    floor.tick()
    assert min_mhz(jetson) == 306


def test_unbalanced_end_and_use_after_close_are_harmless(tmp_path: Path, jetson: Path) -> None:
    floor = engine_floor(tmp_path, FakeClock())
    floor.end()
    assert min_mhz(jetson) == 408
    floor.close()
    floor.begin()
    floor.close()
    assert min_mhz(jetson) == 408 and not floor.was_active


def test_explicit_mhz_and_describe(tmp_path: Path, jetson: Path) -> None:
    floor = engine_floor(tmp_path, FakeClock(), spec="700")
    floor.begin()
    assert min_mhz(jetson) == 714
    assert "714 MHz" in floor.describe() and "17000000.gpu" in floor.describe()
    floor.close()
    assert min_mhz(jetson) == 408


def test_conflicting_writer_is_detected_and_not_fought(tmp_path: Path, jetson: Path, caplog) -> None:
    clock = FakeClock()
    floor = engine_floor(tmp_path, clock)
    floor.begin()
    floor.end()
    set_value(jetson / "min_freq", 612 * MHZ)  # jetson_clocks or a user took over
    clock.now += 2.0
    floor.tick()
    assert min_mhz(jetson) == 612
    assert any("another writer" in r.getMessage() for r in caplog.records)
    floor.begin()  # no raise either while the other writer holds it
    floor.end()
    assert min_mhz(jetson) == 612
    floor.close()  # and no restore over the other writer's value
    assert min_mhz(jetson) == 612


def test_floor_resumes_once_the_other_writer_gives_min_freq_back(tmp_path: Path, jetson: Path) -> None:
    clock = FakeClock()
    floor = engine_floor(tmp_path, clock)
    floor.begin()
    floor.end()
    set_value(jetson / "min_freq", 1020 * MHZ + 1)
    clock.now += 2.0
    floor.tick()
    set_value(jetson / "min_freq", 306 * MHZ)  # e.g. jetson_clocks --restore
    floor.tick()
    floor.begin()
    assert min_mhz(jetson) == 1020
    floor.close()


def test_background_thread_releases_in_real_time(tmp_path: Path, jetson: Path) -> None:
    floor = make_engine_floor(
        "auto",
        sysfs_root=str(tmp_path / "root"),
        state_dir=tmp_path / "state",
        hold_s=0.05,
        handle_signals=False,
    )
    assert floor is not None
    threads = [
        threading.Thread(target=lambda: [floor.begin() or floor.end() for _ in range(200)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the background thread lowers it after the hold: waited for as an event (min_freq is written by then),
    # not by polling the file, which a read between the writer's truncate and write sees empty
    assert floor.wait_lowered(timeout=60.0)
    assert min_mhz(jetson) == 306 and floor.was_active and not floor.raised
    floor.close()
    assert min_mhz(jetson) == 408


@pytest.mark.parametrize("spec,off_gpu", [("off", True), ("auto", False)])
def test_no_floor_when_off_or_experts_on_gpu(tmp_path: Path, jetson: Path, spec: str, off_gpu: bool) -> None:
    assert make_engine_floor(spec, sysfs_root=str(tmp_path / "root"), experts_off_gpu=off_gpu) is None


def test_auto_is_none_and_mhz_an_error_without_a_jetson(tmp_path: Path) -> None:
    assert make_engine_floor("auto", sysfs_root=str(tmp_path)) is None
    with pytest.raises(MoestreamError, match="needs a Jetson GPU devfreq node"):
        make_engine_floor("1020", sysfs_root=str(tmp_path))


@pytest.mark.parametrize("spec", ["fast", "-5", "0", "nan", "inf", ""])
def test_bad_spec_is_a_user_error(spec: str) -> None:
    with pytest.raises(MoestreamError, match="--gpu-floor takes auto, off or a frequency"):
        parse_floor_spec(spec)


def test_mhz_above_the_board_is_a_user_error(tmp_path: Path, jetson: Path) -> None:
    with pytest.raises(MoestreamError, match="above the highest"):
        make_engine_floor("1500", sysfs_root=str(tmp_path / "root"), state_dir=tmp_path / "state")


def test_unwritable_min_freq(tmp_path: Path, jetson: Path, monkeypatch) -> None:
    real_access = os.access
    # what the kernel answers a non-root user for a root-owned 0644 sysfs file (tests may run as root)
    monkeypatch.setattr(
        "moestream.power.devfreq.os.access",
        lambda path, mode: False if mode & os.W_OK else real_access(path, mode),
    )
    assert make_engine_floor("auto", sysfs_root=str(tmp_path / "root")) is None
    with pytest.raises(MoestreamError, match="run as root"):
        make_engine_floor("1020", sysfs_root=str(tmp_path / "root"))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_state(tmp_path: Path, jetson: Path, written_mhz: int) -> Path:
    pid = dead_pid()
    path = tmp_path / "state" / f"gpu-floor.{pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"node": str(jetson), "original_hz": 408 * MHZ, "written_hz": written_mhz * MHZ, "pid": pid}
        )
    )
    return path


def test_floor_left_raised_by_a_dead_run_is_restored_at_next_start(tmp_path: Path, jetson: Path) -> None:
    set_value(jetson / "min_freq", 1020 * MHZ)
    state = write_state(tmp_path, jetson, 1020)
    floor = engine_floor(tmp_path, FakeClock())
    assert min_mhz(jetson) == 408 and not state.exists()
    assert floor._floor.original_hz == 408 * MHZ  # the true original, not the leftover floor
    floor.close()


def test_stale_state_does_not_override_a_newer_value(tmp_path: Path, jetson: Path) -> None:
    set_value(jetson / "min_freq", 612 * MHZ)  # somebody set 612 after the dead run
    state = write_state(tmp_path, jetson, 1020)
    engine_floor(tmp_path, FakeClock()).close()
    assert min_mhz(jetson) == 612 and not state.exists()


def test_state_file_tracks_the_raised_floor_and_goes_away_on_close(tmp_path: Path, jetson: Path) -> None:
    floor = engine_floor(tmp_path, FakeClock())
    floor.begin()
    state = json.loads((tmp_path / "state" / f"gpu-floor.{os.getpid()}.json").read_text())
    assert state["original_hz"] == 408 * MHZ and state["written_hz"] == 1020 * MHZ
    floor.close()
    assert list((tmp_path / "state").iterdir()) == []


CHILD = textwrap.dedent("""
    import sys, time
    from moestream.power.floor import make_engine_floor
    floor = make_engine_floor("auto", sysfs_root=sys.argv[1], state_dir=sys.argv[2])
    floor.begin()
    print("raised", flush=True)
    time.sleep(60)
""")


def _raised_child(tmp_path: Path, ignore_sigint: bool = False) -> subprocess.Popen:
    """CHILD started with the signals' default actions, whatever this process inherited (a shell starts
    background jobs with SIGINT ignored, and an ignored signal stays ignored with the floor), or with
    SIGINT ignored; returns once it has raised the floor."""

    def signals() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "root"), str(tmp_path / "state")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=signals,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "raised"
    except BaseException:
        proc.kill()
        raise
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_restores_min_freq(tmp_path: Path, jetson: Path, signum: int) -> None:
    proc = _raised_child(tmp_path)
    try:
        assert min_mhz(jetson) == 1020
        proc.send_signal(signum)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert min_mhz(jetson) == 408
    assert list((tmp_path / "state").iterdir()) == []
    if signum == signal.SIGTERM:
        assert proc.returncode == -signal.SIGTERM  # still dies of the signal, as without the floor


def test_an_ignored_sigint_restores_min_freq_and_stays_ignored(tmp_path: Path, jetson: Path) -> None:
    """Started with SIGINT ignored (a shell's background job): SIGINT gives min_freq back, and the run
    goes on as it would without the floor; SIGTERM still ends it."""
    proc = _raised_child(tmp_path, ignore_sigint=True)
    try:
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while min_mhz(jetson) != 408 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert min_mhz(jetson) == 408
        assert proc.poll() is None  # still running
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM


def test_gpu_floor_argument() -> None:
    parser = argparse.ArgumentParser()
    add_gpu_floor_argument(parser)
    assert parser.parse_args([]).gpu_floor == "auto"
    assert parser.parse_args(["--gpu-floor", "OFF"]).gpu_floor == "off"
    assert parser.parse_args(["--gpu-floor", "1020"]).gpu_floor == "1020"
    with pytest.raises(SystemExit):
        parser.parse_args(["--gpu-floor", "turbo"])


def test_sysfs_failure_disables_the_floor_without_breaking_inference(
    tmp_path: Path, jetson: Path, caplog
) -> None:
    floor = engine_floor(tmp_path, FakeClock())
    (jetson / "min_freq").unlink()
    (jetson / "min_freq").mkdir()  # any read or write now fails with an OSError
    floor.begin()  # must not raise into the engine's forward pass
    floor.end()
    assert not floor.was_active and any("gpu floor disabled" in r.getMessage() for r in caplog.records)
    floor.close()

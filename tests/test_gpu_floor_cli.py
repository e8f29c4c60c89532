"""`moestream gpu-floor`: --check on a fake tree, install/uninstall, and the daemon as a real process
fed by a fake bpftrace executable (argv, not a shell), stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moestream.cli import main
from moestream.power.daemon import make_daemon_floor
from moestream.power.settings import DaemonSettings, build_settings, read_defaults_file
from moestream.power.testing import add_fake_process, make_fake_jetson, write_fake_elf

MHZ = 1_000_000


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    root = tmp_path / "root"
    node = make_fake_jetson(root, min_mhz=408)
    lib = tmp_path / "llama/libllama.so"
    write_fake_elf(lib, ["llama_decode", "llama_synchronize"])
    return root, node, lib


def test_check_prints_node_frequencies_library_symbols_and_bpftrace(tree, tmp_path: Path, capsys) -> None:
    root, _, lib = tree
    fake_bpftrace = tmp_path / "bin/bpftrace"
    fake_bpftrace.parent.mkdir()
    fake_bpftrace.write_text("#!/bin/sh\n")
    fake_bpftrace.chmod(0o755)
    argv = [
        "gpu-floor",
        "--check",
        "--sysfs-root",
        str(root),
        "--config",
        str(tmp_path / "none"),
        "--library",
        str(lib),
        "--bpftrace",
        str(fake_bpftrace),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"devfreq node: {root}/sys/class/devfreq/17000000.gpu\n" in out
    assert "  available: 306 408 510 612 714 816 918 1020 MHz\n" in out
    assert "  min_freq 408 MHz, max_freq 1020 MHz, cur_freq 306 MHz, governor nvhost_podgov\n" in out
    assert "  floor: 1020 MHz while busy, 306 MHz after 1 s idle\n" in out
    assert (
        f"library: {lib}\n  llama_decode: exported\n  llama_process: missing\n  llama_synchronize: exported\n"
        in out
    )
    assert f"bpftrace: {fake_bpftrace}\n" in out and out.endswith("ready: yes\n")
    assert (root / "sys/class/devfreq/17000000.gpu/min_freq").read_text() == f"{408 * MHZ}\n"  # untouched


def test_check_reports_what_is_missing(tmp_path: Path, capsys) -> None:
    argv = [
        "gpu-floor",
        "--check",
        "--sysfs-root",
        str(tmp_path),
        "--config",
        str(tmp_path / "none"),
        "--library",
        str(tmp_path / "nope/libllama.so"),
        "--bpftrace",
        "/nonexistent/bpftrace",
    ]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "devfreq node: none found" in out and "library: none found" in out
    assert "bpftrace: not found" in out and out.endswith("ready: no\n")


def test_malicious_setting_is_a_clear_user_error(tmp_path: Path, capsys) -> None:
    config = tmp_path / "defaults"
    config.write_text('LIBRARIES="/x/libllama.so\\"; system(\\"id\\")"\n')
    assert main(["gpu-floor", "--check", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moestream: error: gpu-floor settings: LIBRARIES:") and "not an acceptable" in err


def test_install_and_uninstall_under_a_root(tmp_path: Path, capsys) -> None:
    root = tmp_path / "sysroot"
    assert (
        main(
            [
                "gpu-floor",
                "install",
                "--root",
                str(root),
                "--config",
                str(tmp_path / "none"),
                "--floor-mhz",
                "918",
                "--moe-flag=--cpu-moe",
                "--moe-flag=-ot",
            ]
        )
        == 0
    )
    unit = (root / "etc/systemd/system/moestream-gpu-floor.service").read_text()
    assert (
        f"ExecStart={sys.executable} -m moestream gpu-floor --config /etc/default/moestream-gpu-floor\n"
        in unit
    )
    settings = build_settings(read_defaults_file(root / "etc/default/moestream-gpu-floor"))
    assert settings.floor_mhz == 918 and settings.moe_flags == ("--cpu-moe", "-ot")
    assert "systemctl daemon-reload" in capsys.readouterr().out
    assert main(["gpu-floor", "uninstall", "--root", str(root)]) == 0
    assert not (root / "etc/systemd/system/moestream-gpu-floor.service").exists()
    assert not (root / "etc/default/moestream-gpu-floor").exists()


FAKE_BPFTRACE = textwrap.dedent("""\
    #!{python}
    # Stands in for bpftrace: records its argv, then prints what real probes would print.
    import json, sys, time
    import os
    open({argv_file!r}, "w").write(json.dumps([os.getpid()] + sys.argv))
    print("Attaching 4 probes...", flush=True)
    print("moestream-floor enter {dense} {dense} llama_decode", flush=True)
    print("moestream-floor enter {moe} {moe} llama_decode", flush=True)
    time.sleep(0.3)
    print("moestream-floor exit {moe} {moe} llama_decode", flush=True)
    time.sleep(60)
""")


def daemon_cmd(tree: tuple[Path, Path, Path], tmp_path: Path, argv_file: Path) -> list[str]:
    root, _, lib = tree
    add_fake_process(root, 4242, ["llama-server", "-m", "q.gguf", "--cpu-moe"])
    add_fake_process(root, 5151, ["llama-server", "-m", "dense.gguf"])
    fake = tmp_path / "bin/bpftrace"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(
        FAKE_BPFTRACE.format(python=sys.executable, argv_file=str(argv_file), moe=4242, dense=5151)
    )
    fake.chmod(0o755)
    return [
        sys.executable,
        "-m",
        "moestream",
        "gpu-floor",
        "--sysfs-root",
        str(root),
        "--state-dir",
        str(tmp_path / "state"),
        "--config",
        str(tmp_path / "none"),
        "--library",
        str(lib),
        "--bpftrace",
        str(fake),
        "--hold-s",
        "30",
    ]


def test_daemon_process_end_to_end_and_sigterm_restores(tree, tmp_path: Path) -> None:
    _root, node, lib = tree
    argv_file = tmp_path / "bpftrace-argv.json"
    proc = subprocess.Popen(
        daemon_cmd(tree, tmp_path, argv_file)[:-1] + ["0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    min_freq = node / "min_freq"
    try:
        assert wait_for(lambda: min_freq.read_text() == f"{1020 * MHZ}\n"), "floor never raised"
        assert wait_for(lambda: min_freq.read_text() == f"{306 * MHZ}\n"), "floor never released"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert min_freq.read_text() == f"{408 * MHZ}\n"
    assert "floor 1020 MHz (pid 4242 inference)" in err and "floor 306 MHz (idle)" in err
    assert "pid 5151" not in err
    args = json.loads(argv_file.read_text())[1:]
    assert args[1:4] == ["-B", "line", "-e"] and len(args) == 5
    assert f"uprobe:{lib}:llama_decode {{" in args[4] and f"uretprobe:{lib}:llama_synchronize {{" in args[4]
    assert "llama_process" not in args[4]  # not exported by this build: not probed
    assert list((tmp_path / "state").iterdir()) == []


def test_daemon_without_a_jetson_is_a_user_error(tmp_path: Path, capsys) -> None:
    assert (
        main(
            [
                "gpu-floor",
                "--sysfs-root",
                str(tmp_path),
                "--config",
                str(tmp_path / "none"),
                "--state-dir",
                str(tmp_path / "state"),
            ]
        )
        == 2
    )
    assert "no Jetson GPU devfreq node" in capsys.readouterr().err


def test_daemon_killed_with_the_floor_raised_is_undone_at_next_start(tree, tmp_path: Path, capsys) -> None:
    root, node, lib = tree
    argv_file = tmp_path / "bpftrace-argv.json"
    proc = subprocess.Popen(
        daemon_cmd(tree, tmp_path, argv_file), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    min_freq = node / "min_freq"
    try:
        assert wait_for(lambda: min_freq.read_text() == f"{1020 * MHZ}\n"), "floor never raised"
        proc.kill()  # SIGKILL: no handler runs, the floor stays up
        proc.wait(timeout=10)
    finally:
        proc.kill()
        if argv_file.exists():  # the fake bpftrace outlives a SIGKILLed daemon, as the real one would
            os.kill(json.loads(argv_file.read_text())[0], signal.SIGKILL)
    assert min_freq.read_text() == f"{1020 * MHZ}\n" and len(list((tmp_path / "state").iterdir())) == 1
    assert main(["gpu-floor", "--check", "--sysfs-root", str(root), "--config", str(tmp_path / "none")]) in (
        0,
        1,
    )
    assert min_freq.read_text() == f"{1020 * MHZ}\n"  # --check changes nothing
    floor = make_daemon_floor(DaemonSettings(libraries=(str(lib),)), root, tmp_path / "state")
    assert min_freq.read_text() == f"{408 * MHZ}\n" and floor.original_hz == 408 * MHZ
    assert list((tmp_path / "state").iterdir()) == []

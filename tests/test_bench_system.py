"""Machine helpers on fake /sys and cgroup trees: block device of a path (partitions handled), bytes
read from its stat file, readahead, cgroup v2 / v1 memory limits, and the refusals without root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moestream.bench import system
from moestream.cli import main
from moestream.errors import MoestreamError

# a real /sys/block/nvme0n1/stat line: read I/Os, read merges, sectors read, read ticks, writes, ...
NVME_STAT = (
    "  183431     2717 30934386    61562   442851   221093 18283168   401245        0   254096   463079"
)
PART_STAT = (
    "   91022      510 12345678    30110   100000    50000  4000000   100000        0   120000   130110"
)


def fake_sys(root: Path) -> Path:
    """/sys with nvme0n1 (partition nvme0n1p2 = 259:2) and vda (a whole disk, 254:0)."""
    sys_root = root / "sys"
    nvme = sys_root / "devices/pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1"
    (nvme / "queue").mkdir(parents=True)
    (nvme / "stat").write_text(NVME_STAT + "\n")
    (nvme / "queue/read_ahead_kb").write_text("8192\n")
    (nvme / "nvme0n1p2").mkdir()
    (nvme / "nvme0n1p2/partition").write_text("2\n")
    (nvme / "nvme0n1p2/stat").write_text(PART_STAT + "\n")
    vda = sys_root / "devices/pci0000:00/0000:00:05.0/virtio1/block/vda"
    (vda / "queue").mkdir(parents=True)
    (vda / "stat").write_text("10 0 2048 5 0 0 0 0 0 5 5\n")
    (vda / "queue/read_ahead_kb").write_text("128\n")
    (sys_root / "dev/block").mkdir(parents=True)
    (sys_root / "block").mkdir()
    os.symlink(nvme / "nvme0n1p2", sys_root / "dev/block/259:2")
    os.symlink(nvme, sys_root / "dev/block/259:0")
    os.symlink(vda, sys_root / "dev/block/254:0")
    os.symlink(nvme, sys_root / "block/nvme0n1")
    os.symlink(vda, sys_root / "block/vda")
    return sys_root


def test_partition_resolves_to_its_disk_and_bytes_come_from_sectors(tmp_path):
    sys_root = str(fake_sys(tmp_path))
    dev = system.device_for_numbers(259, 2, sys_root)
    assert dev == system.BlockDevice("nvme0n1", "nvme0n1p2", sys_root)
    assert dev.describe() == "nvme0n1 (partition nvme0n1p2)"
    assert dev.bytes_read() == 30934386 * 512
    whole = system.device_for_numbers(259, 0, sys_root)
    assert (whole.disk, whole.partition) == ("nvme0n1", None)
    vda = system.device_for_numbers(254, 0, sys_root)
    assert (vda.disk, vda.partition, vda.bytes_read()) == ("vda", None, 2048 * 512)
    assert system.device_for_numbers(0, 44, sys_root) is None  # tmpfs / overlay: no block device


def test_bytes_read_delta_follows_the_counter(tmp_path):
    sys_root = fake_sys(tmp_path)
    dev = system.device_for_numbers(259, 2, str(sys_root))
    before = dev.bytes_read()
    fields = NVME_STAT.split()
    fields[2] = str(int(fields[2]) + 2048)  # 2048 more sectors = 1 MiB
    (sys_root / "block/nvme0n1/stat").write_text(" ".join(fields) + "\n")
    assert dev.bytes_read() - before == 1 << 20


def test_parse_block_stat_rejects_other_text():
    assert system.parse_block_stat("1 2 3 4") == 3 * 512
    for bad in ("", "1 2", "a b c d e", "cpu  123 0 45 6789"):
        with pytest.raises(ValueError):
            system.parse_block_stat(bad)


def test_readahead_read_and_set(tmp_path):
    dev = system.device_for_numbers(259, 2, str(fake_sys(tmp_path)))
    assert dev.readahead_kb() == 8192
    dev.set_readahead_kb(128)
    assert dev.readahead_kb() == 128
    assert (tmp_path / "sys/block/nvme0n1/queue/read_ahead_kb").read_text() == "128\n"


def test_readahead_set_for_a_block_and_restored_after_an_error(tmp_path):
    dev = system.device_for_numbers(259, 2, str(fake_sys(tmp_path)))
    with system.readahead_set(dev, 128) as before:
        assert (before, dev.readahead_kb()) == (8192, 128)
    assert dev.readahead_kb() == 8192
    with pytest.raises(RuntimeError), system.readahead_set(dev, 4096):
        assert dev.readahead_kb() == 4096
        raise RuntimeError("the run failed")
    assert dev.readahead_kb() == 8192


def test_memory_limited_drops_the_page_cache_first_and_removes_its_group(tmp_path):
    cgroups, proc = tmp_path / "cgroup", tmp_path / "proc"
    cgroups.mkdir()
    (cgroups / "cgroup.controllers").write_text("memory\n")
    (cgroups / "cgroup.subtree_control").write_text("memory\n")
    (proc / "sys/vm").mkdir(parents=True)
    with (
        pytest.raises(RuntimeError),
        system.memory_limited(2 << 30, "mb-test", str(cgroups), str(proc)) as group,
    ):
        assert (proc / "sys/vm/drop_caches").read_text() == "3\n"
        assert (group.path / "memory.max").read_text() == f"{2 << 30}\n"
        (group.path / "memory.max").unlink()  # a real group's files go with it
        raise RuntimeError("the server failed")
    assert not group.path.exists()


def test_device_for_path_finds_the_real_disk_of_this_file():
    dev = system.device_for_path(__file__)
    st = os.stat(__file__).st_dev
    if not Path(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}").exists():
        assert dev is None
    else:
        assert (Path("/sys/block") / dev.disk / "stat").exists()
        assert dev.bytes_read() > 0


def test_cgroup_v2_enables_the_controller_and_sets_memory_max(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    group = system.make_memory_cgroup(3 << 30, "mb-test", str(tmp_path))
    assert (group.version, group.path) == (2, tmp_path / "mb-test")
    assert (tmp_path / "mb-test/memory.max").read_text() == f"{3 << 30}\n"
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory\n"
    (tmp_path / "mb-test/memory.peak").write_text("123456\n")
    assert group.peak_bytes() == 123456
    (tmp_path / "mb-test/memory.stat").write_text(
        "anon 4556062720\nfile 775946240\nkernel 31457280\nfile_mapped 332398592\n"
        "workingset_refault_file 1200\npgmajfault 77\n"
    )
    assert group.stat() == {
        "anon": 4556062720,
        "file": 775946240,
        "file_mapped": 332398592,
        "workingset_refault_file": 1200,
        "pgmajfault": 77,
    }
    (tmp_path / "mb-test/memory.stat").unlink()
    assert group.stat() == {}
    (tmp_path / "mb-test/memory.peak").unlink()
    (tmp_path / "mb-test/memory.max").unlink()
    group.remove()
    assert not group.path.exists()


def test_cgroup_v1_when_the_unified_tree_has_no_memory_controller(tmp_path):
    (tmp_path / "unified").mkdir()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    group = system.make_memory_cgroup(1 << 30, "mb-test", str(tmp_path))
    assert (group.version, group.path) == (1, tmp_path / "memory/mb-test")
    assert (group.path / "memory.limit_in_bytes").read_text() == f"{1 << 30}\n"
    assert group.peak_bytes() is None
    assert group.stat() == {}  # v1's memory.stat names differ: not read


def test_no_memory_controller_is_one_sentence(tmp_path):
    with pytest.raises(MoestreamError, match="no cgroup memory controller"):
        system.make_memory_cgroup(1 << 30, "x", str(tmp_path))


def test_memory_limit_without_root_says_so_and_stops(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    out = tmp_path / "out"
    code = main(["bench", "--model", str(tiny_dir("qwen3_moe")), "--memory-limit", "1GiB", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--memory-limit needs root" in err
    assert not (out / "server.log").exists()  # no server was started


def test_memory_limit_refused_for_a_target(tmp_path, capsys):
    code = main(["bench", "--target", "http://127.0.0.1:9", "--memory-limit", "1GiB", "--out", str(tmp_path)])
    assert code == 2 and "cannot limit a server this command did not start" in capsys.readouterr().err


def _memory_cgroup_root() -> Path | None:
    root = Path("/sys/fs/cgroup")
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return root
    if (root / "memory" / "memory.limit_in_bytes").exists():
        return root / "memory"
    return None


@pytest.mark.skipif(
    os.geteuid() != 0 or _memory_cgroup_root() is None, reason="needs root and a memory cgroup"
)
def test_a_killed_bench_stops_its_server_and_removes_its_cgroup(tiny_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moestream",
            "bench",
            "--model",
            str(tiny_dir("qwen3_moe")),
            "--memory-limit",
            "2GiB",
            "--max-tokens",
            "400",
            "--no-plots",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    group = _memory_cgroup_root() / f"moestream-bench-{proc.pid}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "serving" not in _read(out / "server.log"):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    members = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
    assert members, "the server runs inside the bench's cgroup"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "terminated; stopping the server" in err and "Traceback" not in err
    assert not group.exists()
    for pid in members:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _read(Path(f"/proc/{pid}/status")).lower()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""

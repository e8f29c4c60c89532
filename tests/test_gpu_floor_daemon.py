"""The llama.cpp floor daemon, driven by fake bpftrace lines, a fake clock and a fake sysfs/procfs tree."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from moestream.power.daemon import FloorDaemon, make_daemon_floor
from moestream.power.library import LibraryRef
from moestream.power.settings import DaemonSettings
from moestream.power.testing import add_fake_process, make_fake_jetson, write_fake_elf

MHZ = 1_000_000
MOE, DENSE = 4242, 5151


class FakeSource:
    """Stands in for bpftrace: records the libraries it was started on."""

    def __init__(self, libraries: list[LibraryRef]) -> None:
        self.libraries = libraries
        self.lines: list[str] = []
        self.dead = False
        self.closed = False

    def get(self, timeout: float) -> str | None:
        return self.lines.pop(0) if self.lines else None

    def alive(self) -> bool:
        return not (self.dead or self.closed)

    def close(self) -> None:
        self.closed = True


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "root"
        self.node = make_fake_jetson(self.root)
        self.lib = tmp_path / "llama/build/bin/libllama.so"
        write_fake_elf(self.lib, ["llama_decode", "llama_process", "llama_synchronize"])
        add_fake_process(
            self.root, MOE, ["/opt/llama-server", "-m", "q.gguf", "--n-cpu-moe=40", "--port", "8080"]
        )
        add_fake_process(self.root, DENSE, ["/opt/llama-server", "-m", "dense.gguf"])
        self.settings = DaemonSettings(libraries=(str(self.lib),))
        self.sources: list[FakeSource] = []
        floor = make_daemon_floor(self.settings, self.root, tmp_path / "state")
        self.daemon = FloorDaemon(self.settings, floor, root=self.root, source_factory=self.start)

    def start(self, libraries: list[LibraryRef]) -> FakeSource:
        self.sources.append(FakeSource(libraries))
        return self.sources[-1]

    def min_mhz(self) -> int:
        return int((self.node / "min_freq").read_text()) // MHZ

    def event(self, kind: str, pid: int, now: float, symbol: str = "llama_decode") -> None:
        self.daemon.handle_line(f"moestream-floor {kind} {pid} {pid} {symbol}", now)


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def test_floor_follows_calls_of_moe_processes(rig: Rig, caplog) -> None:
    caplog.set_level(logging.INFO, logger="moestream.power")
    rig.daemon.refresh(0.0)
    rig.event("enter", MOE, 1.0)
    assert rig.min_mhz() == 1020
    rig.event("enter", MOE, 1.1, "llama_synchronize")  # nested call
    rig.event("exit", MOE, 1.2, "llama_synchronize")
    rig.daemon.floor.tick(5.0)  # still inside llama_decode: held
    assert rig.min_mhz() == 1020
    rig.event("exit", MOE, 5.0)
    rig.daemon.floor.tick(5.99)
    assert rig.min_mhz() == 1020
    rig.daemon.floor.tick(6.0)
    assert rig.min_mhz() == 306
    messages = [r.getMessage() for r in caplog.records]
    assert f"floor 1020 MHz (pid {MOE} inference)" in messages and "floor 306 MHz (idle)" in messages


def test_processes_without_the_flags_are_ignored(rig: Rig) -> None:
    rig.daemon.refresh(0.0)
    rig.event("enter", DENSE, 1.0)
    rig.event("enter", 999_999, 1.0)  # no /proc entry: gone already
    assert rig.min_mhz() == 306 and rig.daemon.in_flight == {}
    rig.event("enter", MOE, 2.0)
    rig.event("exit", DENSE, 2.1)  # a dense process returning does not end the MoE call
    rig.daemon.floor.tick(10.0)
    assert rig.min_mhz() == 1020


def test_each_process_holds_the_floor_until_its_own_return(rig: Rig) -> None:
    other = 4343
    add_fake_process(rig.root, other, ["llama-cli", "-cmoe"])
    rig.event("enter", MOE, 1.0)
    rig.event("enter", other, 1.5)
    rig.event("exit", MOE, 2.0)
    rig.daemon.floor.tick(9.0)
    assert rig.min_mhz() == 1020
    rig.event("exit", other, 9.0)
    rig.daemon.floor.tick(10.0)
    assert rig.min_mhz() == 306


def test_return_without_entry_is_ignored(rig: Rig) -> None:
    rig.event("exit", MOE, 1.0)  # attached while a call was running
    assert rig.daemon.in_flight == {}


def test_process_dying_mid_call_releases_the_floor(rig: Rig) -> None:
    rig.event("enter", MOE, 1.0)
    shutil.rmtree(rig.root / f"proc/{MOE}")
    rig.daemon.prune(3.0)
    rig.daemon.floor.tick(3.5)
    assert rig.min_mhz() == 1020
    rig.daemon.floor.tick(4.0)
    assert rig.min_mhz() == 306


def test_reattaches_after_the_library_is_rebuilt(rig: Rig) -> None:
    assert rig.daemon.refresh(0.0) is True
    assert len(rig.sources) == 1 and rig.sources[0].libraries[0].path == str(rig.lib)
    assert rig.daemon.refresh(5.0) is False  # unchanged: keep the probes
    rig.event("enter", MOE, 6.0)
    fresh = rig.lib.with_name("libllama.so.new")
    write_fake_elf(fresh, ["llama_decode", "llama_synchronize"])
    os.replace(fresh, rig.lib)  # what a rebuild and install does: a new inode at the same path
    assert rig.daemon.refresh(10.0) is True
    assert rig.sources[0].closed and len(rig.sources) == 2
    assert rig.sources[1].libraries[0].symbols == ("llama_decode", "llama_synchronize")
    assert rig.daemon.in_flight == {}  # the old probes' returns are lost: counting starts afresh
    rig.daemon.floor.tick(11.0)
    assert rig.min_mhz() == 306


def test_reattaches_when_bpftrace_died_and_waits_without_a_library(rig: Rig, caplog) -> None:
    rig.daemon.refresh(0.0)
    rig.sources[0].dead = True
    assert rig.daemon.refresh(5.0) is True and len(rig.sources) == 2
    rig.lib.unlink()
    assert rig.daemon.refresh(10.0) is False
    assert rig.daemon.source is None and rig.sources[1].closed
    assert any("no libllama.so found" in r.getMessage() for r in caplog.records)
    write_fake_elf(rig.lib, ["llama_decode"])
    assert rig.daemon.refresh(15.0) is True and len(rig.sources) == 3


def test_conflicting_writer_detected_by_the_daemon(rig: Rig, caplog) -> None:
    rig.event("enter", MOE, 1.0)
    rig.event("exit", MOE, 1.5)
    (rig.node / "min_freq").write_text(f"{918 * MHZ}\n")  # not what we wrote: another tool's value
    rig.daemon.floor.tick(3.0)
    assert rig.min_mhz() == 918 and rig.daemon.floor.yielded
    assert any("another writer" in r.getMessage() for r in caplog.records)

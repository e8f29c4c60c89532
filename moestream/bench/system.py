"""The machine under a benchmark: the block device holding a model, its read counter and readahead,
the page cache, and a cgroup memory limit (v2 or v1) to emulate a board with little memory.

Every path is taken relative to `sys_root` / `proc_root` / `cgroup_root`, so tests run these functions
on a fake tree. Functions that change the machine need root; `require_root` says so in one sentence.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moestream.errors import MoestreamError

SECTOR = 512  # /sys/block/*/stat counts 512-byte sectors whatever the device's logical block size


@dataclass(frozen=True)
class BlockDevice:
    """A whole disk (`disk`, e.g. "nvme0n1") and, when the model lives on one, its `partition`."""

    disk: str
    partition: str | None = None
    sys_root: str = "/sys"

    @property
    def stat_path(self) -> Path:
        return Path(self.sys_root) / "block" / self.disk / "stat"

    @property
    def readahead_path(self) -> Path:
        return Path(self.sys_root) / "block" / self.disk / "queue" / "read_ahead_kb"

    def bytes_read(self) -> int:
        """Bytes read from the disk since boot (field 3 of its stat file: sectors read)."""
        return parse_block_stat(self.stat_path.read_text())

    def readahead_kb(self) -> int:
        return int(self.readahead_path.read_text().strip())

    def set_readahead_kb(self, kb: int) -> None:
        """Set the disk's readahead (root only)."""
        self.readahead_path.write_text(f"{kb}\n")

    def describe(self) -> str:
        return self.disk + (f" (partition {self.partition})" if self.partition else "")


def parse_block_stat(text: str) -> int:
    """Bytes read, from the text of a /sys/block/<dev>/stat file (sectors read x 512).

    Raises:
        ValueError: the text does not look like a block stat file.
    """
    fields = text.split()
    if len(fields) < 4 or not all(f.isdigit() for f in fields[:4]):
        raise ValueError(f"not a block device stat line: {text.strip()[:80]!r}")
    return int(fields[2]) * SECTOR


def device_for_numbers(major: int, minor: int, sys_root: str = "/sys") -> BlockDevice | None:
    """The disk behind device number major:minor; None when it is no block device (tmpfs, overlay)."""
    link = Path(sys_root) / "dev" / "block" / f"{major}:{minor}"
    if not link.exists():
        return None
    node = link.resolve()
    if (node / "partition").exists():  # a partition's sysfs directory sits inside its disk's
        return BlockDevice(node.parent.name, node.name, sys_root)
    return BlockDevice(node.name, None, sys_root)


def device_for_path(path: str | os.PathLike[str], sys_root: str = "/sys") -> BlockDevice | None:
    """The disk holding the file or directory `path` (None when it is not on a block device)."""
    dev = os.stat(path).st_dev
    return device_for_numbers(os.major(dev), os.minor(dev), sys_root)


def require_root(what: str) -> None:
    """Raise a one-sentence MoestreamError unless this process runs as root."""
    if os.geteuid() != 0:
        raise MoestreamError(
            f"{what} needs root (it writes to /proc/sys/vm and /sys); run as root or leave it out"
        )


def drop_caches(proc_root: str = "/proc") -> None:
    """Write dirty pages back, then drop the page cache, dentries and inodes (root only)."""
    os.sync()
    (Path(proc_root) / "sys" / "vm" / "drop_caches").write_text("3\n")


MEMORY_STAT_FIELDS = ("anon", "file", "file_mapped", "unevictable", "workingset_refault_file", "pgmajfault")


@dataclass
class MemoryCgroup:
    """A memory-limited cgroup created for one benchmark; `enter` puts the calling process in it."""

    path: Path
    version: int
    limit: int

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def enter(self) -> None:
        """Move the calling process into the group (used as a child's preexec_fn)."""
        self.procs.write_text(f"{os.getpid()}\n")

    def peak_bytes(self) -> int | None:
        """Highest memory use the group saw (page cache included), where the kernel reports it."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text().strip())
        except (OSError, ValueError):
            return None

    def stat(self) -> dict[str, int]:
        """What the group holds now, from memory.stat (v2): anonymous and file pages, the files' mapped share,
        and refaults of file pages since it was made (pages reclaimed under the limit and read again: a
        process whose libraries or working set do not fit). Empty where the kernel does not report it."""
        if self.version != 2:
            return {}
        try:
            text = (self.path / "memory.stat").read_text()
        except OSError:
            return {}
        fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
        return {k: int(fields[k]) for k in MEMORY_STAT_FIELDS if k in fields and fields[k].strip().isdigit()}

    def remove(self, wait_s: float = 10.0) -> None:
        """Remove the group once it is empty: a process that has just exited can hold it busy for a moment."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)


def make_memory_cgroup(
    limit: int, name: str = "moestream-bench", cgroup_root: str = "/sys/fs/cgroup"
) -> MemoryCgroup:
    """Create (or reuse) a cgroup limited to `limit` bytes: v2 if the unified hierarchy has the memory
    controller, else the v1 memory hierarchy. The limit covers the page cache its members fill.

    Raises:
        MoestreamError: neither hierarchy offers a memory controller.
    """
    root = Path(cgroup_root)
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        subtree = root / "cgroup.subtree_control"
        if "memory" not in subtree.read_text().split():
            subtree.write_text("+memory\n")
        group = root / name
        group.mkdir(exist_ok=True)
        (group / "memory.max").write_text(f"{limit}\n")
        return MemoryCgroup(group, 2, limit)
    v1 = root / "memory"
    if (v1 / "memory.limit_in_bytes").exists():
        group = v1 / name
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(f"{limit}\n")
        return MemoryCgroup(group, 1, limit)
    raise MoestreamError(f"no cgroup memory controller under {cgroup_root} (neither v2 nor v1)")


@contextlib.contextmanager
def readahead_set(device: BlockDevice, kb: int) -> Iterator[int]:
    """`device`'s readahead at `kb` KiB for the block (root only); yields what it was, restored after."""
    before = device.readahead_kb()
    device.set_readahead_kb(kb)
    try:
        yield before
    finally:
        device.set_readahead_kb(before)


@contextlib.contextmanager
def memory_limited(
    limit: int, name: str, cgroup_root: str = "/sys/fs/cgroup", proc_root: str = "/proc"
) -> Iterator[MemoryCgroup]:
    """The page cache dropped, then a cgroup `name` limited to `limit` bytes (`make_memory_cgroup`) for the
    block, removed after (root only)."""
    drop_caches(proc_root)
    group = make_memory_cgroup(limit, name, cgroup_root)
    try:
        yield group
    finally:
        group.remove()


def spawn_in(
    argv: list[str],
    cgroup: MemoryCgroup | None,
    log: Path,
    env: dict[str, str] | None = None,
    extra_preexec: Callable[[], None] | None = None,
) -> subprocess.Popen:
    """Start `argv` with stdout and stderr into `log`, inside `cgroup` when one is given."""

    def preexec() -> None:
        if cgroup is not None:
            cgroup.enter()
        if extra_preexec is not None:
            extra_preexec()

    out = open(log, "w")
    try:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=preexec,
            text=True,
        )
    finally:
        out.close()  # the child holds its own copy of the descriptor

"""Memory checked before it is taken, and the trunk locked in memory like the expert cache.

Before the trunk is read and the cache allocated, what a run will hold (the expert cache or the pinned
staging slots, the trunk, the KV cache at the full context, some working memory) is compared with what
the process may still use: every memory cgroup above it (v1 or v2) less the usage that cannot be
reclaimed, and the system's MemAvailable. A run that cannot fit is refused with the numbers; otherwise
mlock faulting in a cache larger than a cgroup's limit gets the process killed with no message.
Locking beyond RLIMIT_MEMLOCK (without CAP_IPC_LOCK) would fail anyway: that is said once, with the
numbers, and the run goes on unlocked.
"""

from __future__ import annotations

import resource
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moestream.errors import MemoryBudgetError
from moestream.io.memory import lock_range, unlock_range
from moestream.units import format_size

WORKING_BYTES = 64 << 20  # activations, allocator slack, the tokenizer: not known before the run
CAP_IPC_LOCK = 14
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as the largest page multiple of a signed 64-bit value


@dataclass(frozen=True)
class Room:
    """Bytes the process may still take under one limit, and the sentence saying which limit."""

    nbytes: int
    why: str


@dataclass
class MemoryNeed:
    """What a run will hold in host memory, part by part (name, bytes), and how much of it is locked."""

    parts: list[tuple[str, int]]
    locked: int = 0

    @property
    def total(self) -> int:
        return sum(n for _, n in self.parts)

    def describe(self) -> str:
        return " + ".join(f"{name} ({format_size(n)})" for name, n in self.parts if n)


def check_memory(
    need: MemoryNeed, rooms: list[Room], cache_part: str = "the expert cache", minimum: int = 1
) -> None:
    """Refuse `need` when it exceeds the tightest room (`minimum`: the smallest cache the model runs with).

    Raises:
        MemoryBudgetError: naming every part of the need, the limit and the largest cache that fits.
    """
    if not rooms:
        return
    room = min(rooms, key=lambda r: r.nbytes)
    if need.total <= room.nbytes:
        return
    others = need.total - dict(need.parts).get(cache_part, 0)
    fits = room.nbytes - others
    if fits >= minimum:
        advice = f"use a cache of at most {format_size(fits)}"
    elif fits > 0:
        advice = (
            f"that leaves {format_size(fits)}, less than the smallest cache this model runs with "
            f"({format_size(minimum)}): free memory or raise the limit"
        )
    else:
        advice = "nothing fits besides the cache: free memory or raise the limit"
    raise MemoryBudgetError(
        f"{need.describe()} need {format_size(need.total)}, but this process may use only "
        f"{format_size(max(room.nbytes, 0))} more ({room.why}); {advice}"
    )


def memory_rooms(root: Path = Path("/")) -> list[Room]:
    """Every limit on the process's memory that could be read: its cgroups, then MemAvailable."""
    rooms = cgroup_rooms(root)
    available = _meminfo(root).get("MemAvailable")
    if available is not None:
        rooms.append(Room(available, f"MemAvailable is {format_size(available)}"))
    return rooms


def cgroup_rooms(root: Path = Path("/")) -> list[Room]:
    """limit - unreclaimable usage of every memory cgroup from the process's own up to the root."""
    rooms = []
    for directory, top, v2 in _cgroup_dirs(root):
        while True:
            room = _cgroup_room(directory, v2)
            if room is not None:
                rooms.append(room)
            if directory == top or directory.parent == directory:
                break
            directory = directory.parent
    return rooms


def _cgroup_dirs(root: Path) -> list[tuple[Path, Path, bool]]:
    """(the process's memory cgroup directory, the hierarchy's mount point, is v2) per hierarchy."""
    try:
        own = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    paths = {}
    for line in own:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0":
            paths[True] = path
        elif "memory" in controllers.split(","):
            paths[False] = path
    found = []
    for line in mounts:
        if " - " not in line:
            continue
        fields, (fstype, _, options) = line.split(), line.split(" - ", 1)[1].split()[:3]
        v2 = fstype == "cgroup2"
        if not (v2 or (fstype == "cgroup" and "memory" in options.split(","))) or v2 not in paths:
            continue
        mount_root, top = Path(fields[3]), root / fields[4].lstrip("/")
        try:
            found.append((top / Path(paths[v2]).relative_to(mount_root), top, v2))
        except ValueError:  # the process's cgroup is outside what this mount shows
            continue
    return found


def _cgroup_room(directory: Path, v2: bool) -> Room | None:
    limit_file, usage_file = (
        ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    try:
        text = (directory / limit_file).read_text().strip()
        if text == "max" or int(text) >= _UNLIMITED:
            return None
        limit, usage = int(text), int((directory / usage_file).read_text())
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    prefix = "" if v2 else "total_"
    file_pages = sum(int(stat.get(prefix + k, 0)) for k in ("inactive_file", "active_file"))
    used = max(usage - file_pages, 0)  # the page cache of files is given back under pressure
    return Room(
        limit - used,
        f"cgroup memory limit {format_size(limit)} at {directory}, {format_size(used)} of it in use",
    )


def _meminfo(root: Path) -> dict[str, int]:
    try:
        lines = (root / "proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def memlock_room(root: Path = Path("/")) -> Room | None:
    """Bytes the process may still mlock (RLIMIT_MEMLOCK less what it holds locked), or None when
    unlimited (no limit, or CAP_IPC_LOCK)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None
    status = process_status(root)
    if int(status.get("CapEff", "0"), 16) >> CAP_IPC_LOCK & 1:
        return None
    locked = int(status.get("VmLck", "0 kB").split()[0]) * 1024
    return Room(soft - locked, f"RLIMIT_MEMLOCK (ulimit -l) is {format_size(soft)}")


def process_status(root: Path = Path("/")) -> dict[str, str]:
    """/proc/self/status as name -> value text (empty when it cannot be read)."""
    try:
        lines = (root / "proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    return {name: value.strip() for name, _, value in (line.partition(":") for line in lines)}


def lock_allowed(need: MemoryNeed, room: Room | None) -> bool:
    """Whether `need.locked` bytes may be locked; if not, say so once, with the numbers."""
    if room is None or need.locked <= room.nbytes:
        return True
    warnings.warn(
        f"locking {format_size(need.locked)} (the expert cache and the trunk) exceeds what "
        f"{room.why} still allows ({format_size(max(room.nbytes, 0))}); running unlocked, so the kernel "
        "may swap them out (raise `ulimit -l` or grant CAP_IPC_LOCK)",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


def storage_ranges(model: Any, device_type: str) -> dict[int, int]:
    """Address -> bytes of every storage behind the model's parameters and buffers on devices of
    `device_type` (a storage shared by several tensors once, empty ones left out)."""
    ranges: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == device_type:
            storage = tensor.untyped_storage()
            if storage.nbytes():
                ranges[storage.data_ptr()] = max(ranges.get(storage.data_ptr(), 0), storage.nbytes())
    return ranges


class TrunkLock:
    """The trunk's tensors (every parameter and buffer on the CPU) locked in memory like the cache."""

    def __init__(self, model: Any) -> None:
        self.ranges = sorted(storage_ranges(model, "cpu").items())
        self.nbytes = sum(n for _, n in self.ranges)
        self.locked = False

    def lock(self) -> bool:
        """mlock every range; on a refusal, unlock what was locked and warn (the run goes on unlocked)."""
        done = []
        for address, nbytes in self.ranges:
            if not lock_range(address, nbytes):
                for a, n in done:
                    unlock_range(a, n)
                warnings.warn(
                    f"could not lock the trunk's {format_size(self.nbytes)} in memory; running it unlocked",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return False
            done.append((address, nbytes))
        self.locked = True
        return True

    def unlock(self) -> None:
        if self.locked:
            for address, nbytes in self.ranges:
                unlock_range(address, nbytes)
            self.locked = False

    def keep_only(self, ranges: list[tuple[int, int]]) -> None:
        """Hold only the host ranges [start, end) (the rest given back, `engine/trunk_release.py`): all
        unlocked, those locked again where the trunk was (`nbytes` stays the trunk's)."""
        was = self.locked
        self.unlock()
        self.ranges = [(start, end - start) for start, end in ranges]
        if was:
            self.lock()

"""What choosing a ggml library needs to know of this machine: where `make native` builds, the CPU flags."""

from __future__ import annotations

import os
from pathlib import Path

from moestream.errors import MoestreamError


def native_dir() -> Path:
    """Where `make native` puts its build: $MOESTREAM_HOME/ggml-native (default ~/.cache/moestream)."""
    home = os.environ.get("MOESTREAM_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "moestream")
    return Path(home) / "ggml-native"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 'flags', ARM 'Features'); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings counted once): llama.cpp's default
    thread count. Falls back to the CPUs it may use where the topology is not readable."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (topo / "physical_package_id").read_text().strip()
                + ":"
                + (topo / "core_id").read_text().strip()
            )
        except OSError:
            return len(allowed)
    return max(1, len(cores))


def default_threads() -> int:
    """`-t` when not given: $MOESTREAM_THREADS, else the physical cores (llama.cpp's rule). ggml's
    threads meet at a spinning barrier after every op, so more threads than free cores costs far more
    than it gives: a loaded machine (a test suite, CI) sets the variable."""
    text = os.environ.get("MOESTREAM_THREADS", "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise MoestreamError(f"MOESTREAM_THREADS={text!r} is not a positive number of threads")
        return n
    return physical_cores()

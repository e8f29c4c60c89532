"""What choosing a ggml library needs to know of this machine: where `make native` builds, the CPU flags."""

from __future__ import annotations

import os
from pathlib import Path


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

"""What the tests that run a child under a cgroup v1 memory limit share (this module holds no tests)."""

from __future__ import annotations

from pathlib import Path

from moestream.cli import main


def write_synth96(out: Path) -> Path:
    """A synthetic qwen3_moe with 96 MiB of experts (2 layers x 64 experts of 768 KiB, top-2) at `out`."""
    sizes = [
        "--layers",
        "2",
        "--experts",
        "64",
        "--top-k",
        "2",
        "--hidden",
        "256",
        "--moe-intermediate",
        "512",
    ]
    assert main(["synth", str(out), "--arch", "qwen3_moe", *sizes]) == 0
    return out


def v1_memory_root() -> Path | None:
    """Where the cgroup v1 memory controller is mounted, or None."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fstype, _, options = line.split(" - ", 1)[1].split()[:3]
        if fstype == "cgroup" and "memory" in options.split(","):
            return Path(line.split()[4])
    return None

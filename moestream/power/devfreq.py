"""The Jetson GPU's devfreq node in sysfs: discovery, reading frequencies, writing `min_freq`.

Jetson kernels expose the integrated GPU as `/sys/class/devfreq/<unit>.<chip>`, for example
`17000000.gpu` (Orin, JetPack 6), `17000000.ga10b` (Orin, JetPack 5), `17000000.gv11b` (Xavier),
`17000000.gp10b` (TX2) or `57000000.gpu` (Nano, TX1). All frequencies in these files are in Hz.
Every path is taken relative to a `root` so that tests can point this module at a fake tree.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# A devfreq name (or its device's name) that is an integrated NVIDIA GPU: "<mmio unit>.<chip or gpu>".
_GPU_NAME_RE = re.compile(r"^[0-9a-f]+\.(gpu|gm20b|gp10b|gv11b|ga10b|gb10b)$")
# Chip names that exist only on Tegra; the generic "*.gpu" also occurs on other SoCs (Mali on Rockchip).
_TEGRA_CHIP_RE = re.compile(r"\.(gm20b|gp10b|gv11b|ga10b|gb10b)$")


def sys_path(root: str | os.PathLike[str], absolute: str) -> Path:
    """`absolute` ("/sys/...") re-rooted under `root` ("/" on a real machine)."""
    return Path(root) / absolute.lstrip("/")


def is_tegra(root: str | os.PathLike[str] = "/") -> bool:
    """True when the board says it is an NVIDIA Tegra (Jetson) through device tree or L4T release file."""
    compatible = sys_path(root, "/proc/device-tree/compatible")
    try:
        if b"nvidia,tegra" in compatible.read_bytes():
            return True
    except OSError:
        pass
    return sys_path(root, "/etc/nv_tegra_release").is_file()


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _names_of(node: Path) -> list[str]:
    """The names a devfreq node goes by: its directory, its `name` file, and its device link."""
    names = [node.name]
    name_file = _read_text(node / "name")
    if name_file:
        names.append(name_file)
    device = node / "device"
    if device.exists():
        names.append(Path(os.path.realpath(device)).name)
    return names


@dataclass(frozen=True)
class DevfreqNode:
    """One devfreq device directory, e.g. /sys/class/devfreq/17000000.gpu."""

    path: Path

    @property
    def name(self) -> str:
        """Directory name, e.g. "17000000.gpu"."""
        return self.path.name

    def _read_int(self, leaf: str) -> int:
        text = _read_text(self.path / leaf)
        if text is None or not text.isdigit():
            raise OSError(f"cannot read an integer from {self.path / leaf}")
        return int(text)

    def available_hz(self) -> list[int]:
        """Sorted frequencies the GPU can run at, in Hz."""
        text = _read_text(self.path / "available_frequencies") or ""
        return sorted({int(tok) for tok in text.split() if tok.isdigit()})

    def min_hz(self) -> int:
        """Current `min_freq` (the floor the governor must respect), in Hz."""
        return self._read_int("min_freq")

    def max_hz(self) -> int:
        """Current `max_freq`, in Hz. Read only: moestream never writes it."""
        return self._read_int("max_freq")

    def cur_hz(self) -> int:
        """The frequency the GPU runs at right now, in Hz."""
        return self._read_int("cur_freq")

    def governor(self) -> str | None:
        """The devfreq governor name (nvhost_podgov on Jetson), or None when unreadable."""
        return _read_text(self.path / "governor")

    def load_permille(self) -> int | None:
        """GPU busy share over the driver's last window, 0..1000 (Jetson `device/load`), or None."""
        text = _read_text(self.path / "device" / "load")
        return int(text) if text is not None and text.isdigit() else None

    def min_writable(self) -> bool:
        """Whether this process may write `min_freq` (needs root on a real board)."""
        return os.access(self.path / "min_freq", os.W_OK)

    def write_min_hz(self, hz: int) -> int:
        """Write `min_freq` and return what the kernel reports back (it may clamp to max_freq)."""
        # Only ever min_freq: max_freq, the governor and other clocks belong to the user and nvpmodel.
        with open(self.path / "min_freq", "w") as fh:
            fh.write(f"{int(hz)}\n")
        return self.min_hz()


def find_gpu_devfreq(root: str | os.PathLike[str] = "/") -> DevfreqNode | None:
    """The integrated GPU's devfreq node under `root`, or None when the machine has none."""
    base = sys_path(root, "/sys/class/devfreq")
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return None
    for entry in entries:
        if any(_GPU_NAME_RE.match(name) for name in _names_of(entry)) and (entry / "min_freq").exists():
            return DevfreqNode(entry)
    return None


def find_jetson_gpu(root: str | os.PathLike[str] = "/") -> DevfreqNode | None:
    """The GPU devfreq node when the machine is a Jetson (Tegra chip name or Tegra board), else None."""
    node = find_gpu_devfreq(root)
    if node is None:
        return None
    if any(_TEGRA_CHIP_RE.search(name) for name in _names_of(node.path)) or is_tegra(root):
        return node
    return None


def mhz(hz: int) -> int:
    """Hz to whole MHz, as printed in logs (1020000000 -> 1020)."""
    return int(round(hz / 1_000_000))

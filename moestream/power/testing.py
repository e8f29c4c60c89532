"""Fakes of the system boundaries the power code talks to, for tests (this package's and the harness's).

`make_fake_jetson` lays out the sysfs/procfs files of a Jetson Orin Nano under a temporary root, shaped
like the real ones (class/devfreq entry linked to the platform device, `device/load`, ina3221 hwmon,
cpufreq); `write_fake_elf` writes a minimal ELF shared object whose dynamic symbol table exports the
given functions (and whose dynamic section names the given libraries), so library probing can be tested
without a compiler.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

ORIN_NANO_MHZ: tuple[int, ...] = (306, 408, 510, 612, 714, 816, 918, 1020)


def _put(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def make_fake_jetson(
    root: str | os.PathLike[str],
    *,
    name: str = "17000000.gpu",
    freqs_mhz: tuple[int, ...] = ORIN_NANO_MHZ,
    min_mhz: int | None = None,
    max_mhz: int | None = None,
    tegra: bool = True,
    cpus: int = 2,
) -> Path:
    """Create a fake Jetson tree under `root`; return the devfreq node directory."""
    root = Path(root)
    device = root / "sys/devices/platform/bus@0" / name
    node = device / "devfreq" / name
    hz = [f * 1_000_000 for f in freqs_mhz]
    _put(node / "available_frequencies", " ".join(map(str, hz)) + "\n")
    _put(node / "min_freq", f"{(min_mhz or freqs_mhz[0]) * 1_000_000}\n")
    _put(node / "max_freq", f"{(max_mhz or freqs_mhz[-1]) * 1_000_000}\n")
    _put(node / "cur_freq", f"{hz[0]}\n")
    _put(node / "governor", "nvhost_podgov\n")
    _put(device / "load", "0\n")
    os.symlink(os.path.relpath(device, node), node / "device")
    link = root / "sys/class/devfreq" / name
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(node, link.parent), link)
    if tegra:
        _put(root / "proc/device-tree/compatible", "nvidia,p3768-0000+p3767-0005\0nvidia,tegra234\0")
    hwmon = root / "sys/class/hwmon/hwmon1"
    _put(hwmon / "name", "ina3221\n")
    for index, (label, mv, ma) in enumerate((("VDD_IN", 5000, 1600), ("VDD_CPU_GPU_CV", 5000, 600)), 1):
        _put(hwmon / f"in{index}_label", label + "\n")
        _put(hwmon / f"in{index}_input", f"{mv}\n")
        _put(hwmon / f"curr{index}_input", f"{ma}\n")
    for cpu in range(cpus):
        _put(root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq", "1510400\n")
    return link


def set_value(path: str | os.PathLike[str], value: int | str) -> None:
    """Overwrite one sysfs-like file, as the kernel or another tool would."""
    Path(path).write_text(f"{value}\n")


def add_fake_process(root: str | os.PathLike[str], pid: int, argv: list[str]) -> None:
    """A /proc/<pid>/cmdline under `root`, NUL-separated like the kernel's."""
    _put(Path(root) / f"proc/{pid}/cmdline", "\0".join(argv) + "\0")


def write_fake_elf(path: str | os.PathLike[str], functions: list[str], needed: list[str] = ()) -> None:
    """A minimal little-endian ELF64 shared object exporting `functions` through .dynsym and naming
    `needed` as DT_NEEDED in a .dynamic section (none without them)."""
    names = list(functions) + list(needed)
    dynstr = b"\0" + b"".join(f.encode() + b"\0" for f in names)
    offsets = [1 + sum(len(n) + 1 for n in names[:i]) for i in range(len(names))]
    shstr = b"\0.dynsym\0.dynstr\0.shstrtab\0.text\0.dynamic\0"
    syms = [bytes(24)]  # the null symbol
    for offset in offsets[: len(functions)]:
        # st_info 0x12: global function; st_shndx 4: defined in .text
        syms.append(struct.pack("<IBBHQQ", offset, 0x12, 0, 4, 0x1000, 16))
    syms.append(struct.pack("<IBBHQQ", 0, 0x12, 0, 0, 0, 0))  # an undefined (imported) symbol: not exported
    dynsym = b"".join(syms)
    # DT_NEEDED entries (offsets into .dynstr), then DT_NULL
    dynamic = b"".join(struct.pack("<qQ", 1, o) for o in offsets[len(functions) :]) + bytes(16)
    body = dynsym + dynstr + shstr + (dynamic if needed else b"")
    shoff = 64 + len(body)
    shnum = 6 if needed else 5
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 3, 183, 1, 0, 0, shoff, 0, 64, 0, 0, 64, shnum, 3)
    sections = [bytes(64)]
    pos = 64
    for name_off, kind, data, link, entsize in (
        (1, 11, dynsym, 2, 24),
        (9, 3, dynstr, 0, 0),
        (17, 3, shstr, 0, 0),
    ):
        sections.append(struct.pack("<IIQQQQIIQQ", name_off, kind, 2, 0, pos, len(data), link, 1, 8, entsize))
        pos += len(data)
    sections.append(struct.pack("<IIQQQQIIQQ", 27, 1, 6, 0x1000, 0, 0, 0, 0, 16, 0))  # .text (empty)
    if needed:  # .dynamic, its strings in .dynstr (section 2)
        sections.append(struct.pack("<IIQQQQIIQQ", 33, 6, 3, 0, pos, len(dynamic), 2, 0, 8, 16))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(header + body + b"".join(sections))

"""`moestream gpu-floor --check`: what the daemon would find, without root and without changing anything."""

from __future__ import annotations

import glob
import os
import shutil

from moestream.power.clockfloor import plan_for
from moestream.power.devfreq import DevfreqNode, find_gpu_devfreq, find_jetson_gpu, mhz, sys_path
from moestream.power.elfsyms import ElfError, exported_functions
from moestream.power.settings import PATH_RE, DaemonSettings


def _node_lines(node: DevfreqNode, settings: DaemonSettings, root: str) -> tuple[list[str], bool]:
    jetson = find_jetson_gpu(root) is not None
    lines = [f"devfreq node: {node.path}" + ("" if jetson else " (not recognised as a Jetson GPU)")]
    lines.append("  available: " + " ".join(str(mhz(hz)) for hz in node.available_hz()) + " MHz")
    try:
        lines.append(
            f"  min_freq {mhz(node.min_hz())} MHz, max_freq {mhz(node.max_hz())} MHz, "
            f"cur_freq {mhz(node.cur_hz())} MHz, governor {node.governor() or '?'}"
        )
    except OSError as exc:
        lines.append(f"  cannot read frequencies: {exc}")
        return lines, False
    ok = jetson
    try:
        plan = plan_for(node, settings.floor_mhz, settings.hold_s)
        lines.append(
            f"  floor: {mhz(plan.target_hz)} MHz while busy, {mhz(plan.idle_hz)} MHz after "
            f"{plan.hold_s:g} s idle"
        )
    except ValueError as exc:
        lines.append(f"  floor: impossible: {exc}")
        ok = False
    writable = "yes" if node.min_writable() else "no (the daemon runs as root)"
    lines.append(f"  min_freq writable by this user: {writable}")
    return lines, ok


def _library_lines(settings: DaemonSettings) -> tuple[list[str], bool]:
    lines: list[str] = []
    usable = False
    seen: set[str] = set()
    for pattern in settings.libraries:
        for match in sorted(glob.glob(pattern)):
            real = os.path.realpath(match)
            if real in seen or not os.path.isfile(real):
                continue
            seen.add(real)
            lines.append(f"library: {real}" + ("" if real == match else f" (from {match})"))
            if not PATH_RE.fullmatch(real):
                lines.append("  path holds characters not allowed in a probe; it will be skipped")
                continue
            try:
                exported = exported_functions(real)
            except (OSError, ElfError) as exc:
                lines.append(f"  unreadable: {exc}")
                continue
            for symbol in settings.symbols:
                lines.append(f"  {symbol}: " + ("exported" if symbol in exported else "missing"))
            usable = usable or any(s in exported for s in settings.symbols)
    if not seen:
        lines.append("library: none found in " + " ".join(settings.libraries))
    return lines, usable


def check_report(settings: DaemonSettings, root: str = "/") -> tuple[str, bool]:
    """The report text, and whether the daemon could run here (node, library and bpftrace found)."""
    node = find_gpu_devfreq(root)
    if node is None:
        lines, node_ok = [f"devfreq node: none found under {sys_path(root, '/sys/class/devfreq')}"], False
    else:
        lines, node_ok = _node_lines(node, settings, root)
    lib_lines, lib_ok = _library_lines(settings)
    lines += lib_lines
    lines.append("moe flags: " + " ".join(settings.moe_flags))
    bpftrace = shutil.which(settings.bpftrace)
    lines.append(f"bpftrace: {bpftrace}" if bpftrace else f"bpftrace: not found ({settings.bpftrace})")
    ok = node_ok and lib_ok and bpftrace is not None
    lines.append("ready: " + ("yes" if ok else "no"))
    return "\n".join(lines) + "\n", ok

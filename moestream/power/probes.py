"""Readers of GPU clock, GPU load, board power and CPU clock, each discovered once and then polled.

Jetson: devfreq `cur_freq` (Hz), the GPU device's `load` (0..1000) and the ina3221 hwmon rail of the
board input (mV x mA). Desktop NVIDIA GPUs: NVML through nvidia-ml-py, imported only when asked for.
Everywhere: cpufreq `scaling_cur_freq` (kHz), else "cpu MHz" in /proc/cpuinfo.
A reader is a zero-argument callable returning a float, or None when the value is not available now.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moestream.power.devfreq import find_jetson_gpu, sys_path

Reader = Callable[[], float | None]
# the rail that carries the whole board's input, by board family (Orin Nano/NX, Nano/TX, AGX Orin)
BOARD_RAILS = ("VDD_IN", "POM_5V_IN", "VIN_SYS_5V0")


def _int_file(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


@dataclass
class Probes:
    """The readers found on this machine and, for the summary, where each one reads from."""

    gpu_clock_mhz: Reader | None = None
    gpu_load_pct: Reader | None = None
    power_w: Reader | None = None
    cpu_clock_mhz: Reader | None = None
    sources: dict[str, str | None] | None = None
    close: Callable[[], None] | None = None


def _board_power(root: str | os.PathLike[str]) -> tuple[Reader, str] | None:
    for hwmon in sorted(sys_path(root, "/sys/class/hwmon").glob("hwmon*")):
        try:
            if (hwmon / "name").read_text().strip() != "ina3221":
                continue
        except OSError:
            continue
        labels = {}
        for label_file in hwmon.glob("in*_label"):
            try:
                labels[label_file.read_text().strip()] = label_file.name[2 : -len("_label")]
            except OSError:
                continue
        for rail in BOARD_RAILS:
            if rail in labels:
                ch = labels[rail]
                volt, curr = hwmon / f"in{ch}_input", hwmon / f"curr{ch}_input"

                def read(volt: Path = volt, curr: Path = curr) -> float | None:
                    mv, ma = _int_file(volt), _int_file(curr)
                    return None if mv is None or ma is None else mv * ma / 1e6

                return read, f"ina3221 {rail}"
    return None


def _cpu_clock(root: str | os.PathLike[str]) -> tuple[Reader, str] | None:
    files = sorted(sys_path(root, "/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq"))
    if files:

        def read_cpufreq() -> float | None:
            values = [v for v in map(_int_file, files) if v is not None]
            return sum(values) / len(values) / 1000.0 if values else None

        return read_cpufreq, "cpufreq"
    cpuinfo = sys_path(root, "/proc/cpuinfo")

    def read_cpuinfo() -> float | None:
        try:
            lines = cpuinfo.read_text().splitlines()
        except OSError:
            return None
        values = [float(l.split(":", 1)[1]) for l in lines if l.lower().startswith("cpu mhz") and ":" in l]
        return sum(values) / len(values) if values else None

    return (read_cpuinfo, "/proc/cpuinfo") if read_cpuinfo() is not None else None


def _nvml() -> tuple[dict[str, Reader], Callable[[], None]] | None:
    """NVML readers for GPU 0, or None without nvidia-ml-py or without an NVIDIA driver."""
    try:
        nvml = importlib.import_module("pynvml")  # nvidia-ml-py; optional, so imported lazily
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # ImportError, or NVMLError when there is no driver or GPU
        return None
    calls: dict[str, Callable[[], float]] = {
        "gpu_clock_mhz": lambda: float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_GRAPHICS)),
        "gpu_load_pct": lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
    }
    readers: dict[str, Reader] = {}
    for name, call in calls.items():
        try:
            call()
        except Exception:  # this metric is not supported on this GPU
            continue

        def read(call: Callable[[], float] = call) -> float | None:
            try:
                return call()
            except Exception:
                return None

        readers[name] = read
    return readers, nvml.nvmlShutdown


def discover(root: str | os.PathLike[str] = "/", nvml: bool | None = None) -> Probes:
    """Find every reader available under `root`. `nvml`: None tries NVML only on the real root."""
    probes = Probes(sources={"gpu": None, "power": None, "cpu": None})
    node = find_jetson_gpu(root)
    if node is not None:
        cur = node.path / "cur_freq"
        probes.gpu_clock_mhz = lambda: None if (v := _int_file(cur)) is None else v / 1e6
        load = node.load_permille
        probes.gpu_load_pct = lambda: None if (v := load()) is None else v / 10.0
        probes.sources["gpu"] = f"jetson devfreq {node.name}"
    elif nvml or (nvml is None and str(root) == "/"):
        found = _nvml()
        if found is not None:
            readers, probes.close = found
            probes.gpu_clock_mhz = readers.get("gpu_clock_mhz")
            probes.gpu_load_pct = readers.get("gpu_load_pct")
            probes.power_w = readers.get("power_w")
            probes.sources["gpu"] = "nvml"
            probes.sources["power"] = "nvml (GPU board)" if probes.power_w else None
    board = _board_power(root)
    if board is not None:
        probes.power_w, probes.sources["power"] = board
    cpu = _cpu_clock(root)
    if cpu is not None:
        probes.cpu_clock_mhz, probes.sources["cpu"] = cpu
    return probes

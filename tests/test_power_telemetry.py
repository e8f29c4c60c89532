"""Telemetry sampler on fake Jetson sysfs, fake /proc/cpuinfo and a fake NVML module."""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

import pytest

from moestream.power.telemetry import TelemetrySampler
from moestream.power.testing import make_fake_jetson, set_value


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_jetson_samples_and_summary(tmp_path: Path) -> None:
    node = make_fake_jetson(tmp_path, cpus=4)
    clock = FakeClock()
    sampler = TelemetrySampler(sysfs_root=str(tmp_path), clock=clock)
    hwmon = tmp_path / "sys/class/hwmon/hwmon1"
    # 2 samples at 306 MHz / 30% / 8 W, then 3 at 1020 MHz / 20% / 10 W, 20 ms apart
    for i, (mhz, load, ma) in enumerate([(306, 300, 1600)] * 2 + [(1020, 200, 2000)] * 3):
        clock.now = i * 0.02
        set_value(node / "cur_freq", mhz * 1_000_000)
        set_value(node / "device/load", load)
        set_value(hwmon / "curr1_input", ma)
        sampler.sample()
    s = sampler.summary(tokens=2)
    assert s["samples"] == 5 and s["duration_s"] == pytest.approx(0.08)
    assert s["sources"] == {"gpu": "jetson devfreq 17000000.gpu", "power": "ina3221 VDD_IN", "cpu": "cpufreq"}
    assert s["gpu_clock_hist_mhz"] == {306: 2, 1020: 3}
    assert s["gpu_clock_mean_mhz"] == pytest.approx((2 * 306 + 3 * 1020) / 5)
    assert s["gpu_load_mean_pct"] == pytest.approx((2 * 30 + 3 * 20) / 5)
    assert s["power_mean_w"] == pytest.approx((2 * 8.0 + 3 * 10.0) / 5)  # 5 V x 1.6 A, 5 V x 2 A
    assert s["energy_j"] == pytest.approx(9.2 * 0.08)
    assert s["energy_per_token_j"] == pytest.approx(9.2 * 0.08 / 2)
    assert s["cpu_clock_mean_mhz"] == pytest.approx(1510.4)


def test_machine_without_gpu_or_power_reports_none(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text(
        "processor\t: 0\ncpu MHz\t\t: 2000.000\nprocessor\t: 1\ncpu MHz\t\t: 3000.0\n"
    )
    sampler = TelemetrySampler(sysfs_root=str(tmp_path), clock=FakeClock())
    sampler.sample()
    s = sampler.summary(tokens=10)
    assert s["gpu_clock_hist_mhz"] is None and s["gpu_load_mean_pct"] is None
    assert s["power_mean_w"] is None and s["energy_per_token_j"] is None
    assert s["cpu_clock_mean_mhz"] == pytest.approx(2500.0)
    assert s["sources"] == {"gpu": None, "power": None, "cpu": "/proc/cpuinfo"}


def test_nothing_sampled_gives_empty_summary(tmp_path: Path) -> None:
    s = TelemetrySampler(sysfs_root=str(tmp_path)).summary(tokens=5)
    assert s["samples"] == 0 and s["gpu_clock_mean_mhz"] is None and s["energy_j"] is None


def fake_pynvml(shutdowns: list[int]) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.NVML_CLOCK_GRAPHICS = 0
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: shutdowns.append(1)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: 1980
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)

    def no_power(h: object) -> int:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    nvml.nvmlDeviceGetPowerUsage = no_power
    return nvml


def test_nvml_is_used_on_desktop_gpus_when_present(tmp_path: Path, monkeypatch) -> None:
    shutdowns: list[int] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(shutdowns))
    sampler = TelemetrySampler(interval_s=0.01, sysfs_root=str(tmp_path), nvml=True)
    with sampler:
        time.sleep(0.05)
    s = sampler.summary()
    assert s["sources"]["gpu"] == "nvml" and s["sources"]["power"] is None  # power unsupported on this GPU
    assert s["gpu_clock_hist_mhz"] == {1980: s["samples"]} and s["gpu_load_mean_pct"] == 87
    assert s["power_mean_w"] is None and shutdowns == [1]


def test_missing_nvml_is_not_an_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    sampler = TelemetrySampler(sysfs_root=str(tmp_path), nvml=True)
    sampler.sample()
    assert sampler.summary()["sources"]["gpu"] is None


def test_background_thread_samples_every_interval(tmp_path: Path) -> None:
    make_fake_jetson(tmp_path)
    with TelemetrySampler(interval_s=0.02, sysfs_root=str(tmp_path)) as sampler:
        time.sleep(0.2)
    s = sampler.summary()
    assert 5 <= s["samples"] <= 13 and s["gpu_clock_hist_mhz"] == {306: s["samples"]}
    assert s["power_mean_w"] == pytest.approx(8.0)


def test_interval_is_validated() -> None:
    with pytest.raises(ValueError, match="telemetry interval"):
        TelemetrySampler(interval_s=0)

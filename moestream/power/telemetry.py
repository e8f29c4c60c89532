"""Telemetry sampler shared by the engine and the benchmark harness.

Every `interval_s` (20 ms by default, as in the seed's measurements) it records GPU clock, GPU load,
board power and mean CPU clock, where the machine exposes them. `summary()` turns the samples into the
numbers the report needs: GPU clock histogram, mean load, mean power, and energy per token.

    with TelemetrySampler() as sampler:
        tokens = run_decode()
    print(sampler.summary(tokens))
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from moestream.power.probes import Probes, discover


@dataclass(frozen=True)
class Sample:
    """One reading; None where the machine does not expose that value."""

    t: float  # seconds, from the sampler's clock
    gpu_clock_mhz: float | None
    gpu_load_pct: float | None
    power_w: float | None
    cpu_clock_mhz: float | None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class TelemetrySampler:
    """Background sampler; start()/stop() or use it as a context manager."""

    def __init__(
        self,
        interval_s: float = 0.02,
        sysfs_root: str = "/",
        *,
        nvml: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.001 <= interval_s <= 60.0:
            raise ValueError(f"telemetry interval must be between 1 ms and 60 s, got {interval_s}")
        self.interval_s = interval_s
        self.sysfs_root = sysfs_root
        self._nvml = nvml
        self._clock = clock
        self._probes: Probes | None = None
        self._sources: dict[str, str | None] = {}
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def probes(self) -> Probes:
        """The readers found on this machine (discovered on first use)."""
        if self._probes is None:
            self._probes = discover(self.sysfs_root, self._nvml)
            self._sources = dict(self._probes.sources or {})
        return self._probes

    @property
    def samples(self) -> list[Sample]:
        """A copy of the samples taken so far."""
        with self._lock:
            return list(self._samples)

    def sample(self) -> Sample:
        """Take one reading now (the thread calls this; tests may too)."""
        p = self.probes

        def read(reader: Callable[[], float | None] | None) -> float | None:
            return reader() if reader is not None else None

        s = Sample(
            self._clock(), read(p.gpu_clock_mhz), read(p.gpu_load_pct), read(p.power_w), read(p.cpu_clock_mhz)
        )
        with self._lock:
            self._samples.append(s)
        return s

    def start(self) -> TelemetrySampler:
        """Clear earlier samples and start sampling in a background thread."""
        if self._thread is not None:
            raise RuntimeError("telemetry sampler already started")
        with self._lock:
            self._samples.clear()
        self._stop.clear()
        _ = self.probes  # discover before the first tick, so it does not delay it
        self._thread = threading.Thread(target=self._run, name="moestream-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (one last reading closes the window) and release NVML if it was used."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample()
        if self._probes is not None and self._probes.close is not None:
            self._probes.close()
            self._probes = None  # NVML is shut down: discover again on the next start()

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            # fixed schedule: a slow read delays one sample, not all the following ones
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def summary(self, tokens: int | None = None) -> dict[str, object]:
        """Aggregates over the samples. Keys whose metric is unavailable hold None.

        gpu_clock_hist_mhz maps whole MHz to a sample count; energy_j = mean power x sampled duration;
        energy_per_token_j = energy_j / tokens (only when tokens is given and power is known).
        """
        samples = self.samples
        duration = samples[-1].t - samples[0].t if len(samples) >= 2 else 0.0
        clocks = [s.gpu_clock_mhz for s in samples if s.gpu_clock_mhz is not None]
        power = _mean([s.power_w for s in samples if s.power_w is not None])
        energy = power * duration if power is not None and duration > 0 else None
        hist = Counter(int(round(c)) for c in clocks)
        return {
            "samples": len(samples),
            "duration_s": duration,
            "interval_s": self.interval_s,
            "sources": dict(self._sources),
            "gpu_clock_hist_mhz": dict(sorted(hist.items())) if clocks else None,
            "gpu_clock_mean_mhz": _mean(clocks),
            "gpu_load_mean_pct": _mean([s.gpu_load_pct for s in samples if s.gpu_load_pct is not None]),
            "power_mean_w": power,
            "energy_j": energy,
            "energy_per_token_j": energy / tokens if energy is not None and tokens else None,
            "cpu_clock_mean_mhz": _mean([s.cpu_clock_mhz for s in samples if s.cpu_clock_mhz is not None]),
        }

"""GPU clock floor (Jetson devfreq `min_freq`) and telemetry sampling. No torch here: it imports fast.

- `make_engine_floor` / `EngineFloor`: the floor the engine raises while it computes (`floor.py`).
- `moestream gpu-floor`: the same floor for llama.cpp, driven by bpftrace uprobes (`daemon.py`).
- `TelemetrySampler`: GPU clock, GPU load, board power and CPU clock every 20 ms (`telemetry.py`).
"""

from __future__ import annotations

from moestream.power.floor import EngineFloor, make_engine_floor
from moestream.power.telemetry import TelemetrySampler

__all__ = ["EngineFloor", "TelemetrySampler", "make_engine_floor"]

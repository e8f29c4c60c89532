"""GPU clock floor (Jetson devfreq `min_freq`) and telemetry sampling. No torch here: it imports fast.

- `make_engine_floor` / `EngineFloor`: the floor the engine raises while it computes (`floor.py`).
"""
from __future__ import annotations

from moestream.power.floor import EngineFloor, make_engine_floor

__all__ = ["EngineFloor", "make_engine_floor"]

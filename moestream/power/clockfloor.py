"""The floor state machine shared by the engine and the llama.cpp daemon.

It knows nothing about threads, clocks or where activity comes from: callers tell it "busy" and "idle"
with a timestamp and call `tick(now)`; it decides when to write `min_freq`. That keeps it testable with
a fake clock and lets the engine (begin/end calls) and the daemon (uprobe events) share one policy:

    idle --busy--> raised (min_freq = target) --idle for hold_s--> lowered (min_freq = idle value)

If `min_freq` ever reads differently from what this floor last wrote, another tool (jetson_clocks,
nvpmodel, a user) owns it now: the floor warns and stops writing until that value is given back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from moestream.power.devfreq import DevfreqNode, mhz
from moestream.power.state import FloorState, StateFile

log = logging.getLogger("moestream.power")


@dataclass(frozen=True)
class FloorPlan:
    """Frequencies and timing of one floor, all validated against the node's available frequencies."""

    target_hz: int
    idle_hz: int
    hold_s: float = 1.0

    def __post_init__(self) -> None:
        if self.target_hz <= 0 or self.idle_hz <= 0:
            raise ValueError(
                f"floor frequencies must be positive, got {self.target_hz} and {self.idle_hz} Hz"
            )
        if self.idle_hz > self.target_hz:
            raise ValueError(
                f"idle frequency {mhz(self.idle_hz)} MHz is above the floor {mhz(self.target_hz)} MHz"
            )
        if not 0.0 <= self.hold_s <= 3600.0:
            raise ValueError(f"hold time must be between 0 and 3600 s, got {self.hold_s}")


def plan_for(node: DevfreqNode, floor_mhz: float | None, hold_s: float = 1.0) -> FloorPlan:
    """Pick the floor for `node`: the lowest available frequency >= `floor_mhz` (None: the highest
    one that max_freq allows) while busy, and the lowest available frequency when idle.

    Raises:
        ValueError: the node lists no frequencies, or `floor_mhz` is above all of them.
    """
    available = node.available_hz()
    if not available:
        raise ValueError(f"{node.path}/available_frequencies lists no frequencies")
    if floor_mhz is None:
        try:
            cap = node.max_hz()  # nvpmodel may cap max_freq; a floor above it would just be clamped
        except OSError:
            cap = available[-1]
        allowed = [hz for hz in available if hz <= cap] or available[:1]
        return FloorPlan(allowed[-1], available[0], hold_s)
    wanted = int(round(floor_mhz * 1_000_000))
    above = [hz for hz in available if hz >= wanted]
    if not above:
        raise ValueError(
            f"{floor_mhz:g} MHz is above the highest frequency of {node.name} ({mhz(available[-1])} MHz)"
        )
    return FloorPlan(above[0], available[0], hold_s)


class ClockFloor:
    """Raises `min_freq` while busy and lowers it `hold_s` after the last activity. Not thread-safe:
    callers serialise calls (the engine holds a lock, the daemon has a single loop)."""

    def __init__(self, node: DevfreqNode, plan: FloorPlan, state: StateFile | None = None) -> None:
        self.node = node
        self.plan = plan
        self.state = state
        self.original_hz = node.min_hz()
        self._expected = self.original_hz  # what min_freq reads while nobody else writes it
        self.raised = False
        self.was_active = False
        self.yielded = False  # another writer owns min_freq; hands off until it gives it back
        self.disabled = False  # a write failed; never try again in this run
        self._busy = False
        self._idle_since: float | None = None

    def busy(self, now: float, who: str) -> None:
        """Activity started (or continues); `who` names it in the log, e.g. "pid 42 inference"."""
        self._busy = True
        self._idle_since = None
        if not self.raised:
            self._write(self.plan.target_hz, f"({who})")

    def idle(self, now: float) -> None:
        """Nothing is in flight any more; the hold time starts now."""
        if self._busy or self._idle_since is None:
            self._idle_since = now
        self._busy = False

    def tick(self, now: float) -> float | None:
        """Lower the floor when the hold time has passed; return seconds until it is due, else None."""
        if self.yielded:
            self._maybe_resume()
            return None
        if not self.raised or self._busy or self._idle_since is None:
            return None
        remaining = self._idle_since + self.plan.hold_s - now
        if remaining > 0:
            return remaining
        self._write(self.plan.idle_hz, "(idle)")
        return None

    def close(self) -> None:
        """Put back the `min_freq` found at start, unless another writer has taken over."""
        try:
            if (
                not (self.yielded or self.disabled)
                and self._owned()
                and self.node.min_hz() != self.original_hz
            ):
                self.node.write_min_hz(self.original_hz)
                log.info("floor %d MHz (restored)", mhz(self.original_hz))
        except OSError as exc:
            log.warning(
                "could not restore %s min_freq to %d MHz: %s", self.node.name, mhz(self.original_hz), exc
            )
            return  # keep the state file: the next start retries the restore
        self.raised = False
        if self.state is not None:
            self.state.remove()

    def _owned(self) -> bool:
        current = self.node.min_hz()
        if current == self._expected:
            return True
        self.yielded = True
        log.warning(
            "%s min_freq changed to %d MHz by another writer (jetson_clocks?); moestream leaves it "
            "alone until it is back at %d MHz",
            self.node.name,
            mhz(current),
            mhz(self.plan.idle_hz),
        )
        return False

    def _maybe_resume(self) -> None:
        try:
            current = self.node.min_hz()
        except OSError:
            return
        if current in (self.plan.idle_hz, self.original_hz):
            self.yielded, self.raised, self._expected = False, False, current
            log.info("%s min_freq is back at %d MHz; floor resumes", self.node.name, mhz(current))

    def _write(self, hz: int, reason: str) -> None:
        if self.disabled:
            return
        try:
            if self.yielded:
                self._maybe_resume()
                if self.yielded:
                    return
            if not self._owned():
                return
            # record before writing: a crash between the two must still leave a trace to undo
            self._save_state(hz)
            self._expected = self.node.write_min_hz(hz)
            if self._expected != hz:  # the kernel clamped it; recovery compares with what it reads
                self._save_state(self._expected)
        except OSError as exc:
            self.disabled = True
            log.error("gpu floor disabled: %s", exc)
            return
        self.raised = hz == self.plan.target_hz
        self.was_active = self.was_active or self.raised
        log.info("floor %d MHz %s", mhz(hz), reason)

    def _save_state(self, written_hz: int) -> None:
        if self.state is not None:
            self.state.save(FloorState(str(self.node.path), self.original_hz, written_hz, self.state.pid))

"""`moestream gpu-floor`: raise the Jetson GPU clock floor while llama.cpp computes MoE experts on the CPU.

The daemon watches uprobe events from bpftrace, counts calls in flight per process (only processes
whose command line holds one of the MoE-on-CPU flags), and drives a `ClockFloor` with them. Every
`recheck_s` seconds it re-resolves the libraries and re-attaches when one was rebuilt or bpftrace died.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from moestream.power.bpftrace import BpftraceSource, EventSource, bpftrace_argv, build_program, parse_event
from moestream.power.clockfloor import ClockFloor, plan_for
from moestream.power.devfreq import find_jetson_gpu, mhz, sys_path
from moestream.power.errors import GpuFloorError
from moestream.power.library import LibraryRef, resolve_libraries
from moestream.power.settings import DaemonSettings
from moestream.power.state import StateFile, default_state_dir, recover

log = logging.getLogger("moestream.power")

SourceFactory = Callable[[list[LibraryRef]], EventSource]
PRUNE_S = 1.0  # how often processes that died mid-call are dropped from the in-flight count


def bpftrace_factory(settings: DaemonSettings) -> SourceFactory:
    """A factory that starts real bpftrace on the given libraries."""

    def start(libraries: list[LibraryRef]) -> EventSource:
        return BpftraceSource(bpftrace_argv(settings.bpftrace, build_program(libraries)))

    return start


class FloorDaemon:
    """Event handling and library watching; `run()` is the loop, the other methods take `now` so
    tests can drive them with a fake clock and fake lines."""

    def __init__(
        self,
        settings: DaemonSettings,
        floor: ClockFloor,
        *,
        root: str | os.PathLike[str] = "/",
        source_factory: SourceFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.floor = floor
        self.root = root
        self.clock = clock
        self._factory = source_factory or bpftrace_factory(settings)
        self.source: EventSource | None = None
        self.libraries: list[LibraryRef] = []
        self.in_flight: dict[int, int] = {}  # pid -> calls entered and not yet returned
        self._is_moe: dict[int, bool] = {}  # pid -> command line holds a MoE-on-CPU flag
        self._warned_missing = False

    # --- events ---------------------------------------------------------------------------------
    def handle_line(self, line: str, now: float) -> None:
        """Account one line of bpftrace output."""
        event = parse_event(line)
        if event is None:
            if line.strip():
                log.info("bpftrace: %s", line.strip())
            return
        log.debug("%s", line.strip())
        if not self.moe_process(event.pid):
            return
        if event.kind == "enter":
            self.in_flight[event.pid] = self.in_flight.get(event.pid, 0) + 1
            self.floor.busy(now, f"pid {event.pid} inference")
        elif self.in_flight.get(event.pid, 0) > 0:  # an exit without entry: attached mid-call
            self.in_flight[event.pid] -= 1
            if self.in_flight[event.pid] == 0:
                del self.in_flight[event.pid]
                if not self.in_flight:
                    self.floor.idle(now)

    def moe_process(self, pid: int) -> bool:
        """Whether `pid`'s command line holds one of the MoE-on-CPU flags (cached per pid)."""
        cached = self._is_moe.get(pid)
        if cached is not None:
            return cached
        try:
            argv = sys_path(self.root, f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False  # gone already; do not cache, the pid may be reused
        args = [a.decode("utf-8", "replace") for a in argv]
        flags = self.settings.moe_flags
        hit = any(a == f or a.startswith(f + "=") for a in args for f in flags)
        self._is_moe[pid] = hit
        return hit

    def prune(self, now: float) -> None:
        """Forget processes that exited (a crash mid-call leaves no return event behind)."""
        for pid in list(self._is_moe):
            if not sys_path(self.root, f"/proc/{pid}").exists():
                self._is_moe.pop(pid, None)
                if self.in_flight.pop(pid, None) and not self.in_flight:
                    self.floor.idle(now)

    # --- libraries --------------------------------------------------------------------------------
    def refresh(self, now: float) -> bool:
        """Re-resolve the libraries; (re)start the source when they changed or it died. True if it did."""
        libraries = resolve_libraries(self.settings.libraries, self.settings.symbols)
        source_ok = self.source is not None and self.source.alive()
        if libraries == self.libraries and (source_ok or not libraries):
            return False
        if self.source is not None:
            if not source_ok:
                log.warning("bpftrace ended; re-attaching")
            self.source.close()
            self.source = None
        if self.in_flight:  # return events of the old probes are lost; start counting afresh
            self.in_flight.clear()
            self.floor.idle(now)
        self.libraries = libraries
        if not libraries:
            if not self._warned_missing:
                log.warning("no libllama.so found in %s; waiting for one", " ".join(self.settings.libraries))
                self._warned_missing = True
            return False
        self._warned_missing = False
        self.source = self._factory(libraries)
        for lib in libraries:
            log.info("attached to %s (%s)", lib.path, ", ".join(lib.symbols))
        return True

    # --- loop -------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set; always stop bpftrace and restore `min_freq` on the way out."""
        next_refresh = next_prune = self.clock()
        try:
            while not stop.is_set():
                now = self.clock()
                if now >= next_refresh:
                    self.refresh(now)
                    next_refresh = now + self.settings.recheck_s
                if now >= next_prune:
                    self.prune(now)
                    next_prune = now + PRUNE_S
                due = self.floor.tick(now)
                timeout = min(t for t in (due, next_refresh - now, next_prune - now, 0.5) if t is not None)
                if self.source is None:
                    stop.wait(max(timeout, 0.0))
                    continue
                line = self.source.get(max(timeout, 0.0))
                if line is not None:
                    self.handle_line(line, self.clock())
        finally:
            if self.source is not None:
                self.source.close()
            self.floor.close()


def make_daemon_floor(
    settings: DaemonSettings,
    root: str | os.PathLike[str] = "/",
    state_dir: str | os.PathLike[str] | None = None,
) -> ClockFloor:
    """The floor the daemon drives, after undoing what a crashed earlier run left behind.

    Raises:
        GpuFloorError: no Jetson GPU devfreq node, `min_freq` not writable, or an impossible floor.
    """
    node = find_jetson_gpu(root)
    if node is None:
        raise GpuFloorError(f"no Jetson GPU devfreq node under {sys_path(root, '/sys/class/devfreq')}.")
    if not node.min_writable():
        raise GpuFloorError(f"cannot write {node.path}/min_freq; the daemon must run as root.")
    try:
        plan = plan_for(node, settings.floor_mhz, settings.hold_s)
    except ValueError as exc:
        raise GpuFloorError(f"gpu floor: {exc}.") from None
    directory = Path(state_dir) if state_dir is not None else default_state_dir(root)
    for pid in recover(directory, node):
        log.warning(
            "another gpu floor (pid %d) also drives %s; they may overwrite each other", pid, node.name
        )
    return ClockFloor(node, plan, StateFile(directory))


def serve(settings: DaemonSettings, floor: ClockFloor, root: str | os.PathLike[str] = "/") -> int:
    """Run the daemon in the foreground until SIGTERM or SIGINT; returns the exit code."""
    plan = floor.plan
    log.info(
        "gpu floor on %s: %d MHz while busy, %d MHz after %g s idle (min_freq was %d MHz)",
        floor.node.name,
        mhz(plan.target_hz),
        mhz(plan.idle_hz),
        plan.hold_s,
        mhz(floor.original_hz),
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: restoring min_freq and exiting", signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    FloorDaemon(settings, floor, root=root).run(stop)
    return 0

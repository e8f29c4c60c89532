"""The GPU clock floor as the moestream engine uses it: `make_engine_floor(spec)` and `EngineFloor`.

With routed experts computed on the CPU, the Jetson GPU (attention, shared expert, router) works in
short bursts and the load governor keeps it at its lowest clock, although it sits on the critical path
of every token. The engine brackets each forward pass with `begin()` / `end()`; the floor raises
`min_freq` at the first `begin()` and lowers it `hold_s` after the last `end()`.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from moestream.power.clockfloor import ClockFloor, plan_for
from moestream.power.devfreq import find_jetson_gpu, mhz
from moestream.power.errors import GpuFloorError
from moestream.power.state import StateFile, default_state_dir, recover

log = logging.getLogger("moestream.power")

Clock = Callable[[], float]


def parse_floor_spec(spec: str) -> str | float:
    """ "auto" / "off" as given, or the floor in MHz as a float. Raises GpuFloorError otherwise."""
    text = str(spec).strip().lower()
    if text in ("auto", "off"):
        return text
    try:
        value = float(text.removesuffix("mhz"))
    except ValueError:
        value = float("nan")
    if not 0 < value < 100_000:  # also rejects nan and inf
        raise GpuFloorError(f"--gpu-floor takes auto, off or a frequency in MHz (e.g. 1020), not {spec!r}.")
    return value


class EngineFloor:
    """Thread-safe, nesting-safe front of a `ClockFloor` for the engine.

    `begin()`/`end()` may be nested and called from several threads; the floor is raised while the
    count is above zero. A background thread lowers it after the hold time (unless `background=False`,
    then the caller drives `tick()`, as tests with a fake clock do).
    """

    def __init__(
        self, floor: ClockFloor, spec: str, *, clock: Clock = time.monotonic, background: bool = True
    ) -> None:
        self._floor = floor
        self._spec = spec
        self._clock = clock
        self._background = background
        self._cond = threading.Condition(threading.RLock())  # re-entrant: a signal handler may close
        self._depth = 0
        self._closed = False
        self._worker: threading.Thread | None = None
        self._who = f"pid {os.getpid()} inference"

    @property
    def was_active(self) -> bool:
        """True once the floor has been raised at least once in this run."""
        return self._floor.was_active

    @property
    def raised(self) -> bool:
        """True while `min_freq` is at the floor."""
        return self._floor.raised

    def describe(self) -> str:
        """One line for the run's mode line."""
        plan = self._floor.plan
        return (
            f"gpu floor {self._spec}: {self._floor.node.name} min_freq {mhz(plan.target_hz)} MHz while "
            f"computing, {mhz(plan.idle_hz)} MHz after {plan.hold_s:g} s idle"
        )

    def begin(self) -> None:
        """Inference activity starts (a forward pass, a decode step)."""
        with self._cond:
            if self._closed:
                return
            self._depth += 1
            if self._depth == 1:
                self._floor.busy(self._clock(), self._who)
                self._ensure_worker()

    def end(self) -> None:
        """The activity started by the matching `begin()` is over."""
        with self._cond:
            if self._closed or self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0:
                self._floor.idle(self._clock())
                self._cond.notify_all()

    @contextmanager
    def activity(self) -> Iterator[None]:
        """`with floor.activity():` brackets a block with begin()/end()."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    def tick(self) -> float | None:
        """Lower the floor if the hold time passed; seconds until it is due, or None."""
        with self._cond:
            return None if self._closed else self._floor.tick(self._clock())

    def wait_lowered(self, timeout: float) -> bool:
        """Wait until the floor is not raised (lowered after the hold, or closed), at most `timeout`
        seconds; whether it is. `min_freq` is written by then: the writes happen under the same lock."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or not self._floor.raised, timeout)

    def close(self) -> None:
        """Restore the original `min_freq` and stop. Idempotent; later begin()/end() do nothing."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._floor.close()
            self._cond.notify_all()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=2.0)

    def __enter__(self) -> EngineFloor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_worker(self) -> None:
        if self._background and self._worker is None:
            self._worker = threading.Thread(target=self._run, name="moestream-gpu-floor", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        # SIGINT and SIGTERM are the main thread's, where Python runs their handlers (min_freq restored by
        # `install_restore_handlers`): one the kernel gave this thread would wait for the main thread's
        # next bytecode, which a main thread asleep or blocked defers (a child asleep kept its floor)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        with self._cond:
            while not self._closed:
                due = self._floor.tick(self._clock())
                self._cond.notify_all()  # `wait_lowered`
                # Yielded to another writer: poll now and then for it to give min_freq back.
                timeout = due if due is not None else (1.0 if self._floor.yielded else None)
                self._cond.wait(timeout=timeout)


def install_restore_handlers(floor: EngineFloor) -> None:
    """Restore `min_freq` on normal exit, SIGTERM and SIGINT, then let the previous handler act."""
    atexit.register(floor.close)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers normal exit
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)

        def handler(num: int, frame: FrameType | None, previous: object = previous) -> None:
            floor.close()
            if callable(previous):
                previous(num, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(num, signal.SIG_DFL)  # die the way the signal would have killed us
                os.kill(os.getpid(), num)

        signal.signal(signum, handler)


def make_engine_floor(
    spec: str,
    *,
    sysfs_root: str = "/",
    experts_off_gpu: bool = True,
    hold_s: float = 1.0,
    state_dir: str | os.PathLike[str] | None = None,
    clock: Clock = time.monotonic,
    background: bool = True,
    handle_signals: bool = True,
) -> EngineFloor | None:
    """Build the engine's floor from `--gpu-floor` (auto, off, or MHz), or None when none applies.

    auto: only on a Jetson whose GPU devfreq `min_freq` this process may write, and only when the
    routed experts are computed off the GPU. MHz: always, or a GpuFloorError saying why it cannot.
    """
    mode = parse_floor_spec(spec)
    if mode == "off" or (mode == "auto" and not experts_off_gpu):
        return None
    node = find_jetson_gpu(sysfs_root)
    if node is None:
        if mode == "auto":
            return None
        raise GpuFloorError(
            f"--gpu-floor {spec} needs a Jetson GPU devfreq node, and none was found "
            f"under {Path(sysfs_root) / 'sys/class/devfreq'}."
        )
    if not node.min_writable():
        if mode == "auto":
            log.warning("gpu floor not applied: %s/min_freq is not writable (run as root)", node.path)
            return None
        raise GpuFloorError(f"--gpu-floor {spec} cannot write {node.path}/min_freq; run as root.")
    try:
        plan = plan_for(node, None if mode == "auto" else float(mode), hold_s)
    except ValueError as exc:
        raise GpuFloorError(f"--gpu-floor {spec}: {exc}.") from None
    directory = Path(state_dir) if state_dir is not None else default_state_dir(sysfs_root)
    for pid in recover(directory, node):
        log.warning(
            "another gpu floor (pid %d) also drives %s; they may overwrite each other", pid, node.name
        )
    floor = EngineFloor(
        ClockFloor(node, plan, StateFile(directory)),
        str(spec).strip().lower(),
        clock=clock,
        background=background,
    )
    if handle_signals:
        install_restore_handlers(floor)
    return floor

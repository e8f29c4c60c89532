"""The bpftrace side of the daemon: the probe program, its output lines, and the child process.

The program is assembled only from library paths and symbol names that passed the whitelist in
`settings`, and bpftrace is started from an argv list (never through a shell). Each probe prints one
line per event:

    moestream-floor enter <pid> <tid> <symbol>
    moestream-floor exit <pid> <tid> <symbol>
"""

from __future__ import annotations

import logging
import queue
import re
import subprocess
import threading
from dataclasses import dataclass
from typing import Protocol

from moestream.power.errors import GpuFloorError
from moestream.power.library import LibraryRef
from moestream.power.settings import PATH_RE, PROGRAM_NAME_RE, SYMBOL_RE

log = logging.getLogger("moestream.power")

TAG = "moestream-floor"
EVENT_RE = re.compile(TAG + r" (enter|exit) ([0-9]{1,10}) ([0-9]{1,10}) ([A-Za-z_][A-Za-z0-9_]{0,127})")


@dataclass(frozen=True)
class Event:
    """One uprobe hit: a watched function was entered or returned in process `pid`, thread `tid`."""

    kind: str  # "enter" or "exit"
    pid: int
    tid: int
    symbol: str


def parse_event(line: str) -> Event | None:
    """The event on one line of bpftrace output, or None for anything else ("Attaching 6 probes...")."""
    match = EVENT_RE.fullmatch(line.strip())
    if match is None:
        return None
    return Event(match.group(1), int(match.group(2)), int(match.group(3)), match.group(4))


def build_program(libraries: list[LibraryRef]) -> str:
    """bpftrace program text with entry and return probes on every watched symbol of every library.

    Raises:
        GpuFloorError: a path or symbol is outside the whitelist (defence in depth: settings and
            library resolution already refuse them), or there is nothing to probe.
    """
    lines: list[str] = []
    for lib in libraries:
        if not PATH_RE.fullmatch(lib.path):
            raise GpuFloorError(
                f"refusing to probe {lib.path!r}: the path holds characters not allowed in a probe."
            )
        for symbol in lib.symbols:
            if not SYMBOL_RE.fullmatch(symbol):
                raise GpuFloorError(f"refusing to probe symbol {symbol!r}: not a C identifier.")
            for probe, kind in (("uprobe", "enter"), ("uretprobe", "exit")):
                lines.append(
                    f'{probe}:{lib.path}:{symbol} {{ printf("{TAG} {kind} %d %d {symbol}\\n", pid, tid); }}'
                )
    if not lines:
        raise GpuFloorError("no library symbols to probe.")
    return "\n".join(lines) + "\n"


def bpftrace_argv(bpftrace: str, program: str) -> list[str]:
    """argv for running `program`; `-B line` so events arrive as they happen, not when a buffer fills."""
    if not (PATH_RE.fullmatch(bpftrace) or PROGRAM_NAME_RE.fullmatch(bpftrace)):
        raise GpuFloorError(f"refusing to run {bpftrace!r} as bpftrace: not a plain program path.")
    return [bpftrace, "-B", "line", "-e", program]


class EventSource(Protocol):
    """Where the daemon's lines come from: bpftrace in production, a fake in tests."""

    def get(self, timeout: float) -> str | None:
        """The next output line, or None when none arrived within `timeout` seconds."""

    def alive(self) -> bool:
        """False once the source has ended (bpftrace exited)."""

    def close(self) -> None:
        """Stop the source and release its resources."""


class BpftraceSource:
    """bpftrace as a child process; a reader thread moves its output lines into a queue."""

    def __init__(self, argv: list[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        try:
            # argv list, no shell: the program text reaches bpftrace as one argument, verbatim.
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
        except OSError as exc:
            raise GpuFloorError(f"cannot start {argv[0]}: {exc.strerror or exc}.") from None
        self._reader = threading.Thread(target=self._read, name="moestream-bpftrace", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line.rstrip("\n"))

    def get(self, timeout: float) -> str | None:
        """Next line of bpftrace output within `timeout` seconds, else None."""
        try:
            return self._lines.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def alive(self) -> bool:
        """True while bpftrace runs or lines it printed are still queued."""
        return self._proc.poll() is None or not self._lines.empty()

    def returncode(self) -> int | None:
        """bpftrace's exit status once it ended."""
        return self._proc.poll()

    def close(self) -> None:
        """Stop bpftrace (SIGTERM, then SIGKILL after 3 s): its uprobes go away with it."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reader.join(timeout=1.0)

"""Crash recovery: a small JSON file per floor owner records the `min_freq` it found and what it wrote.

A run that dies with the floor raised (SIGKILL, power cut of the process, a bug) leaves its file behind.
The next floor to start finds it, sees the owner is gone and puts the original value back, unless
someone else has changed `min_freq` since: then the file is stale and only removed.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from moestream.power.devfreq import DevfreqNode, mhz, sys_path

log = logging.getLogger("moestream.power")

STATE_PREFIX = "gpu-floor."


@dataclass
class FloorState:
    """What one floor owner did to one devfreq node."""

    node: str
    original_hz: int
    written_hz: int
    pid: int


def default_state_dir(root: str | os.PathLike[str] = "/") -> Path:
    """/run/moestream under `root`; a per-user temp dir when that is not writable (tests, non-root)."""
    run_dir = sys_path(root, "/run/moestream")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if os.access(run_dir, os.W_OK):
            return run_dir
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"moestream-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class StateFile:
    """The state file of this process (`gpu-floor.<pid>.json`) in `directory`."""

    def __init__(self, directory: Path, pid: int | None = None) -> None:
        self.directory = Path(directory)
        self.pid = os.getpid() if pid is None else pid
        self.path = self.directory / f"{STATE_PREFIX}{self.pid}.json"

    def save(self, state: FloorState) -> None:
        """Write atomically (rename), so a crash mid-write never leaves half a file."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state)))
        os.replace(tmp, self.path)

    def remove(self) -> None:
        """Forget the state (after the original value was restored)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def _load(path: Path) -> FloorState | None:
    try:
        data = json.loads(path.read_text())
        return FloorState(
            str(data["node"]), int(data["original_hz"]), int(data["written_hz"]), int(data["pid"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recover(directory: Path, node: DevfreqNode) -> list[int]:
    """Undo floors left raised by dead owners of `node`; return the pids of live owners found."""
    live: list[int] = []
    for path in sorted(Path(directory).glob(f"{STATE_PREFIX}*.json")):
        state = _load(path)
        if state is None:
            log.warning("removing unreadable gpu floor state file %s", path)
            path.unlink(missing_ok=True)
            continue
        if state.node != str(node.path):
            continue
        if state.pid != os.getpid() and _pid_alive(state.pid):
            live.append(state.pid)
            continue
        _restore_stale(state, node)
        path.unlink(missing_ok=True)
    return live


def _restore_stale(state: FloorState, node: DevfreqNode) -> None:
    try:
        current = node.min_hz()
    except OSError:
        return
    if current != state.written_hz:
        # Someone changed min_freq after that run died; their value wins.
        log.info(
            "gpu floor state of pid %d is stale (min_freq now %d MHz); left as is", state.pid, mhz(current)
        )
        return
    if current == state.original_hz:
        return
    try:
        node.write_min_hz(state.original_hz)
    except OSError as exc:
        log.warning("could not restore min_freq of %s left by pid %d: %s", node.name, state.pid, exc)
        return
    log.warning(
        "restored %s min_freq to %d MHz (left at %d MHz by pid %d, which died)",
        node.name,
        mhz(state.original_hz),
        mhz(current),
        state.pid,
    )

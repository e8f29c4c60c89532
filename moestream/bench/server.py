"""A benchmark's own server process: `moestream serve` (or any server with GET /health, such as
llama-server) started as a child on a free loopback port, optionally inside a memory cgroup, and
stopped with SIGTERM when the benchmark ends.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from moestream.bench.system import MemoryCgroup, spawn_in
from moestream.errors import MoestreamError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: a benchmark killed with SIGKILL must not leave its server running
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def moestream_serve_argv(
    model: str, port: int, engine_args: list[str], trace: str | None = None
) -> list[str]:
    """The command line of `moestream serve` for a benchmark (loopback, a queue of one is enough)."""
    argv = [
        sys.executable,
        "-m",
        "moestream",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--queue-size",
        "2",
        *engine_args,
    ]
    return argv + (["--trace", trace] if trace else [])


class ServerProcess:
    """A child server; `url` is its base URL (no /v1), `log` holds its stdout and stderr."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        log: Path,
        cgroup: MemoryCgroup | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv, self.log, self.cgroup = argv, log, cgroup
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen = spawn_in(argv, cgroup, log, env, _die_with_parent)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Poll GET /health until it answers 200.

        Raises:
            MoestreamError: the process exited or did not become ready in time (the log's tail is quoted).
        """
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise MoestreamError(
                        f"the server exited with status {self.proc.returncode} before it was "
                        f"ready: {self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise MoestreamError(f"the server was not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 600) -> str:
        try:
            return " ".join(self.log.read_text(errors="replace")[-chars:].split())
        except OSError:
            return "(no log)"

    def mode_line(self) -> str | None:
        """moestream's mode line, the first line its server prints (None for other servers)."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return None
        return next((line for line in lines if line.startswith("moestream: ") and " | io " in line), None)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

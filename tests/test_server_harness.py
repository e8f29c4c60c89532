"""A live `moestream serve` subprocess shared by the server tests (this module holds no tests).

One server per checkpoint for the whole session: starting one costs seconds (torch and transformers
imports), so the API, error and soak tests all talk to the same process and measure deltas. The
served checkpoint is a copy of the tiny qwen3_moe with its context raised to 4096, so that a request
can run for seconds and be cancelled or queued behind deterministically.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

KEY = "test-key-0123"
CONTEXT = 4096
SERVER_ARGS = [
    "--cache",
    "1MiB",
    "--api-key",
    KEY,
    "--queue-size",
    "4",
    "--max-body",
    "64KiB",
    "--threads",
    "1",
    "-np",  # one slot (serve's default is auto): the queue tests count one request running
    "1",
]
_servers: dict[str, LiveServer] = {}


def _die_with_parent() -> None:
    # a killed pytest must not leave a server behind: PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class LiveServer:
    """`python -m moestream serve PATH --port 0 ...`, with clients and readers of /metrics and RSS."""

    def __init__(self, path: Path, args: list[str], positional: bool = True) -> None:
        self.path = path  # `positional=False`: args name it (-m PATH)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="moestream-serve-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        where = [str(path)] if positional else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moestream", "serve", *where, "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            preexec_fn=_die_with_parent,
        )
        self.url = self._wait_for_url(timeout=120)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the mode line, then the serving line; nothing else goes to stdout
            match = re.search(r"serving .* on (http://[^/\s]+)/v1", line)
            if match:
                return match.group(1)
            if time.monotonic() > deadline:
                break
        self.proc.kill()
        raise RuntimeError(f"server did not start: {Path(self.log.name).read_text()[-3000:]}")

    def client(self, **kwargs) -> openai.OpenAI:
        """The real openai client pointed at this server."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60, **kwargs)

    @property
    def model(self) -> str:
        return self.path.name

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            match = re.match(r"^([a-zA-Z_:]+)(?:\{(.*)\})? (\S+)$", line)
            if not match or match.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(match.group(3))
        return total

    def wait_idle(self, timeout: float = 30) -> None:
        """Until no request runs or waits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = self.http.get("/health").json()
            if not health["running"] and health["waiting"] == 0:
                return
            time.sleep(0.01)
        raise AssertionError("the server stayed busy")

    def log_text(self) -> str:
        """What the server wrote to stderr so far (access log, warnings)."""
        return Path(self.log.name).read_text()

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


def long_context_copy(src: Path) -> Path:
    """A copy of a tiny checkpoint with a 4096-token context (rotary positions: no weights change)."""
    dst = Path(tempfile.mkdtemp(prefix="moestream-serve-")) / src.name.replace("-", "_")
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    atexit.register(shutil.rmtree, dst.parent, True)
    return dst


def shared_server(tiny: Path) -> LiveServer:
    """The session's server for the tiny checkpoint `tiny` (started on first use)."""
    key = str(tiny)
    if key not in _servers:
        server = LiveServer(long_context_copy(tiny), SERVER_ARGS)
        atexit.register(server.stop)
        _servers[key] = server
    return _servers[key]

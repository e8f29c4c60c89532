"""The server under abuse: huge prompts beside small requests, half-open connections, a connection flood.

    python benchmarks/server_abuse.py CHECKPOINT [--tree DIR] [--big 4] [--chars 4000000] [--sockets 40]

Starts `moestream serve CHECKPOINT --max-body 5MiB` from the source tree DIR (default: this one; give
another worktree to compare before and after), then:
  1. sends `--big` completions of `--chars` characters at once, with a small completion every 100 ms
     beside them; reports each big one's status and seconds, the small ones' median and worst latency,
     and the server's RSS before, at its peak and 3 s after;
  2. opens `--sockets` connections that send nothing (or half a request head) and counts, 1 s past the
     server's request timeout (2 s here where supported), how many the server still holds open.
Loopback only. Prints one block of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def _start(tree: Path, path: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "moestream", "serve", path, "--port", "0", "--max-body", "5MiB", *extra]
    proc = subprocess.Popen(  # cwd: `python -m` puts it first on sys.path
        args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=tree
    )
    for line in proc.stdout:
        match = re.search(r"serving .* on (http://[^/\s]+)/v1", line)
        if match:
            return proc, match.group(1)
    raise RuntimeError("the server did not start")


def _big_prompts(url: str, pid: int, n: int, chars: int) -> dict:
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    big: list[tuple[int, float]] = []
    small: list[float] = []
    peak = [_rss_mib(pid)]
    done = threading.Event()

    def one_big() -> None:
        start = time.perf_counter()
        r = httpx.post(
            f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=300
        )
        big.append((r.status_code, time.perf_counter() - start))

    def smalls() -> None:
        with httpx.Client(timeout=300) as client:
            while not done.is_set():
                start = time.perf_counter()
                client.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                small.append(time.perf_counter() - start)
                peak.append(_rss_mib(pid))
                time.sleep(0.1)

    before = _rss_mib(pid)
    watcher = threading.Thread(target=smalls)
    watcher.start()
    threads = [threading.Thread(target=one_big) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    time.sleep(3)
    return {
        "big": sorted(big),
        "small_median_s": statistics.median(small),
        "small_max_s": max(small),
        "small_n": len(small),
        "rss_before": before,
        "rss_peak": max(peak),
        "rss_after": _rss_mib(pid),
    }


def _half_open(url: str, n: int, wait: float) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = []
    for i in range(n):
        s = socket.create_connection((host, int(port)))
        if i % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # half a head, never ended
        socks.append(s)
    time.sleep(wait)
    still = 0
    for s in socks:
        s.settimeout(0.2)
        try:
            data = s.recv(1024)
            still += data != b"" and b"503" not in data
        except TimeoutError:
            still += 1  # nothing came and the connection is open
        except OSError:
            pass
        s.close()
    return {"sockets": n, "still_open_after_s": wait, "still_open": still}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--tree", type=Path, default=ROOT)
    p.add_argument("--big", type=int, default=4)
    p.add_argument("--chars", type=int, default=4_000_000)
    p.add_argument("--sockets", type=int, default=40)
    args = p.parse_args()
    help_text = subprocess.run(
        [sys.executable, "-m", "moestream", "serve", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(args.tree)},
        cwd=args.tree,
    ).stdout
    extra = ["--request-timeout", "2"] if "--request-timeout" in help_text else []
    proc, url = _start(args.tree, args.path, extra)
    try:
        figures = _big_prompts(url, proc.pid, args.big, args.chars)
        figures.update(_half_open(url, args.sockets, 3.0 if extra else 10.0))
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps({"tree": str(args.tree), **figures}, indent=1))


if __name__ == "__main__":
    main()

"""Several requests at once (issue 33), server against server: llama.cpp's `llama-server -np N` and
`moestream serve -np N` on the same GGUF file, through the same HTTP client, side by side in one run.

    python benchmarks/batch_servers.py FILE.gguf [--llama-server BIN] [--streams 1,4] [--tokens 64]
                                       [--reps 3] [--threads N] [--ctx 512] [--out FILE.json]
                                       [--moestream-args "--cache 2GiB"] [--llama-args "..."]
                                       [--memory-limit 5GiB] [--read-ahead KB]

    # the issue-33 run: a GPU machine used as a 16-core CPU, a CUDA build of llama-server on the CPU
    CUDA_VISIBLE_DEVICES= python benchmarks/batch_servers.py MODEL.gguf \
        --llama-server /tmp/llama.cpp-cuda-sm90/llama-server --threads 16 --out batch_servers.json

Each server is started once, with N = the most streams: llama-server as `BIN -m FILE -np N -t THREADS
-c N*CTX -ngl 0 --host 127.0.0.1 --port P` (its -c is split across the slots, so each slot gets CTX),
moestream as `python -m moestream serve FILE -np N --threads THREADS --ctx-size CTX` (every expert in RAM
when they fit: its default --cache auto; `--moestream-args` sets a budget). After GET /health answers 200
and one warm-up round of N requests, each run sends S distinct code prompts at once to /v1/completions
(`max_tokens` = --tokens, temperature 0, `ignore_eos`, no prompt cache) from S threads, and reports, median
over --reps: the aggregate decode rate (the sum of each request's `timings.predicted_per_second`: they
decode side by side), the wall rate (every generated token over the time from the first send to the last
answer, prefill included), each server's aggregate at S over its aggregate at one stream, and the
moestream/llama-server ratios at each S. moestream's expert bytes read per generated token, and its
batch's decode steps and their mean rows (how many requests a step carried), come from its /metrics.
Both servers' bytes read from the file's disk per generated token come from the disk's own counter
(/sys/block/*/stat, read around each run; other readers of the disk count too).

Streaming (issue 33's second regime): `--memory-limit SIZE` starts each server in a cgroup of its own
limited to SIZE (its page cache counted: what llama-server's mmap keeps of the file, and moestream's
`--cache auto` sizes itself by it), with the page cache dropped before each server starts; the table then
gives each server's peak and the cgroup's memory.stat at its end. llama-server runs there with
`--no-repack` (as benchmarks/llamacpp/side_by_side.py runs it under a limit): its default copies the Q4_K
weights into a repacked anonymous buffer the size of the model, read once and never streamed, and was
killed by the 5 GiB limit before it was ready (12-07, eighth session). `--read-ahead KB` sets the disk's
read-ahead for the whole run (llama-server reads its file through the page cache; restored after).
Both need root. Without --llama-server only moestream runs. Server logs go next to --out (else a
temporary directory); the servers are stopped on every exit path. llama-server must not see a GPU
(`CUDA_VISIBLE_DEVICES=`) for a CPU-only comparison: `-ngl 0` alone still lets a CUDA build offload
large prompt batches.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from batch import PROMPTS  # beside this script

from moestream.bench import system
from moestream.bench.server import ServerProcess, free_port
from moestream.errors import MoestreamError
from moestream.units import format_size, parse_size

MiB = 1 << 20


def llama_argv(binary: str, gguf: str, port: int, slots: int, args: argparse.Namespace) -> list[str]:
    """llama-server on the CPU with `slots` slots of --ctx tokens each (its -c is shared by the slots)."""
    argv = [binary, "-m", gguf, "-np", str(slots), "-t", str(args.threads), "-c", str(slots * args.ctx)]
    argv += ["-ngl", "0", "--host", "127.0.0.1", "--port", str(port)]
    if args.memory_limit is not None:  # its repacked copy of the weights is anonymous memory: not streamed
        argv.append("--no-repack")
    return argv + shlex.split(args.llama_args)


def moestream_argv(gguf: str, port: int, slots: int, args: argparse.Namespace) -> list[str]:
    """`moestream serve` with `slots` slots of --ctx tokens each; a queue that never refuses a run."""
    argv = [sys.executable, "-m", "moestream", "serve", gguf, "-np", str(slots)]
    argv += [
        "--threads",
        str(args.threads),
        "--ctx-size",
        str(args.ctx),
        "--queue-size",
        str(max(16, 2 * slots)),
    ]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    return argv + shlex.split(args.moestream_args)


def complete(client: httpx.Client, url: str, prompt: str, tokens: int) -> dict:
    """One greedy, fixed-length /v1/completions request; the same body for both servers."""
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,  # every run prefills its prompt afresh on both servers
        "stream": False,
    }
    sent = time.perf_counter()
    res = client.post(f"{url}/v1/completions", json=body)
    answered = time.perf_counter()
    if res.status_code != 200:
        raise MoestreamError(f"{url}/v1/completions answered {res.status_code}: {res.text[:400]}")
    out = res.json()
    if "timings" not in out:
        raise MoestreamError(f"{url}/v1/completions answered without `timings`: {str(out)[:400]}")
    t = out["timings"]
    return {
        "sent": sent,
        "answered": answered,
        "predicted_n": t["predicted_n"],
        "predicted_ms": t["predicted_ms"],
        "predicted_per_second": t["predicted_per_second"],
        "prompt_n": t["prompt_n"],
        "prompt_ms": t["prompt_ms"],
        "bytes_read": (out.get("moe") or {}).get("bytes_read"),  # moestream's per-request figure
        # moestream's: the time its forwards waited for expert reads over the request's span (with
        # several requests at once, the engine's over that span, as bytes_read)
        "read_wait_ms": (out.get("moe") or {}).get("read_wait_ms"),
    }


COUNTERS = ("expert_bytes_read", "decode_steps", "decode_rows")  # moestream's, from /metrics


def counters(client: httpx.Client, url: str) -> dict[str, float]:
    """moestream's COUNTERS from /metrics (those it has; none for servers without them)."""
    try:
        res = client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return {}
    if res.status_code != 200:
        return {}
    found = {}
    for name in COUNTERS:
        match = re.search(rf"^moestream_{name}(?:_total)? (\S+)$", res.text, re.M)
        if match:
            found[name] = float(match.group(1))
    return found


def run(client: httpx.Client, url: str, streams: int, tokens: int, disk: system.BlockDevice | None) -> dict:
    """S distinct prompts at once, one thread each: the figures of one run (`disk`: the file's, whose
    read counter gives the bytes read during it)."""
    before = counters(client, url)
    disk_before = disk.bytes_read() if disk is not None else None
    results: list[dict | BaseException | None] = [None] * streams
    barrier = threading.Barrier(streams)

    def one(i: int) -> None:
        try:
            barrier.wait()
            results[i] = complete(client, url, PROMPTS[i % len(PROMPTS)], tokens)
        except BaseException as e:  # handed to the main thread
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    reqs: list[dict] = results  # type: ignore[assignment]
    disk_read = disk.bytes_read() - disk_before if disk is not None and disk_before is not None else None
    after = counters(client, url)
    grew = {k: after[k] - before[k] for k in after if k in before}
    made = sum(r["predicted_n"] for r in reqs)
    wall = max(r["answered"] for r in reqs) - min(r["sent"] for r in reqs)
    short = [r["predicted_n"] for r in reqs if r["predicted_n"] != tokens]
    if short:
        print(f"  warning: {len(short)} request(s) generated {short} tokens, not {tokens}", file=sys.stderr)
    return {
        "aggregate": sum(r["predicted_per_second"] for r in reqs),
        "wall": made / wall,
        "wall_s": wall,
        "tokens": made,
        "mib_per_token": grew["expert_bytes_read"] / made / MiB if "expert_bytes_read" in grew else None,
        # the disk's own count, for either server (llama-server's page cache misses; moestream's reads)
        "disk_mib_per_token": disk_read / made / MiB if disk_read is not None else None,
        # the batch's decode steps in the run and their mean rows (how many requests each step carried)
        "decode_steps": grew.get("decode_steps"),
        "rows_per_step": grew["decode_rows"] / grew["decode_steps"] if grew.get("decode_steps") else None,
        "requests": [{k: v for k, v in r.items() if k not in ("sent", "answered")} for r in reqs],
    }


def measure(
    name: str,
    argv: list[str],
    port: int,
    log: Path,
    args: argparse.Namespace,
    streams: list[int],
    disk: system.BlockDevice | None = None,
) -> dict:
    """Start one server (under --memory-limit: in a cgroup of its own, the page cache dropped first), warm
    it up, run every stream count --reps times, stop it (on every exit path)."""
    print(f"{name}: {shlex.join(argv)}\n  log: {log}", flush=True)
    entry: dict = {"argv": argv, "log": str(log), "runs": {}}
    with contextlib.ExitStack() as limited:  # the cgroup removed on every exit path
        cgroup = None
        if args.memory_limit is not None:
            try:
                cgroup = limited.enter_context(
                    system.memory_limited(args.memory_limit, f"moestream-batch-{os.getpid()}-{name}")
                )
            except (MoestreamError, OSError) as e:
                entry["error"] = f"--memory-limit: {e}"
                print(f"  {name} FAILED: {entry['error']}", file=sys.stderr, flush=True)
                return entry
            entry["memory_limit"] = args.memory_limit
        started = time.perf_counter()
        with (
            ServerProcess(argv, port, log, cgroup) as server,
            httpx.Client(timeout=args.request_timeout) as client,
        ):
            try:
                server.wait_ready(args.ready_timeout)
                entry["ready_s"] = time.perf_counter() - started
                entry["mode_line"] = server.mode_line()
                if entry["mode_line"]:
                    print(f"  {entry['mode_line']}")
                print(f"  ready after {entry['ready_s']:.1f} s; warm-up: {max(streams)} requests", flush=True)
                run(client, server.url, max(streams), args.tokens, disk)
                for s in streams:
                    reps = []
                    for _ in range(args.reps):
                        if server.proc.poll() is not None:
                            raise MoestreamError(f"exited with status {server.proc.returncode}")
                        reps.append(run(client, server.url, s, args.tokens, disk))
                        rows, read = reps[-1]["rows_per_step"], reps[-1]["disk_mib_per_token"]
                        print(
                            f"  {s} stream(s): aggregate {reps[-1]['aggregate']:.2f} tok/s, "
                            f"wall {reps[-1]['wall']:.2f} tok/s"
                            + (f", {rows:.2f} rows a decode step" if rows is not None else "")
                            + (f", {read:.1f} MiB read from disk a token" if read is not None else ""),
                            flush=True,
                        )
                    entry["runs"][s] = {
                        "aggregate": statistics.median(r["aggregate"] for r in reps),
                        "wall": statistics.median(r["wall"] for r in reps),
                        "mib_per_token": median_or_none([r["mib_per_token"] for r in reps]),
                        "disk_mib_per_token": median_or_none([r["disk_mib_per_token"] for r in reps]),
                        "reps": reps,
                    }
                if cgroup is not None:
                    entry["memory_stat"] = cgroup.stat()  # what the group holds at the end, server running
            except (MoestreamError, httpx.HTTPError) as e:
                status = server.proc.poll()
                dead = "" if status is None else f" (the server exited with status {status})"
                tail = server.log_tail(1500)
                entry["error"] = f"{e}{dead}" + ("" if tail in str(e) else f"; log tail: {tail}")
                print(f"  {name} FAILED: {entry['error']}", file=sys.stderr, flush=True)
        if cgroup is not None:
            entry["peak_bytes"] = cgroup.peak_bytes()
    return entry


def median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def table(servers: dict[str, dict], streams: list[int]) -> dict:
    """Print the table and the moestream/llama-server ratios; return the ratios."""
    print(
        "\nserver       | streams | aggregate decode tok/s | wall tok/s (prefill incl.) | x one stream "
        "| MiB/token | disk MiB/token"
    )
    for name, entry in servers.items():
        runs = entry["runs"]
        one = runs.get(1)
        for s in streams:
            r = runs.get(s)
            if r is None:
                print(f"{name:12} | {s:7} | {'failed':>22} |")
                continue
            scale = f"{r['aggregate'] / one['aggregate']:.2f}" if one and one["aggregate"] else "-"
            r["x_one_stream"] = float(scale) if scale != "-" else None
            mib = f"{r['mib_per_token']:.2f}" if r["mib_per_token"] is not None else "-"
            disk = f"{r['disk_mib_per_token']:.2f}" if r.get("disk_mib_per_token") is not None else "-"
            print(
                f"{name:12} | {s:7} | {r['aggregate']:22.2f} | {r['wall']:26.2f} | {scale:>12} | {mib:>9} "
                f"| {disk:>14}"
            )
    for name, entry in servers.items():
        if entry.get("memory_limit") is not None:
            peak = entry.get("peak_bytes")
            stat = entry.get("memory_stat") or {}
            held = ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in stat.items() if k in ("anon", "file"))
            print(
                f"{name}: limit {format_size(entry['memory_limit'])}, peak "
                f"{format_size(peak) if peak is not None else '-'}" + (f"; at the end {held}" if held else "")
            )
    ratios: dict = {}
    ms, ll = servers.get("moestream", {}).get("runs", {}), servers.get("llama-server", {}).get("runs", {})
    if ms and ll:
        print("\nmoestream / llama-server | streams | aggregate | wall")
        for s in streams:
            if s in ms and s in ll and ll[s]["aggregate"] and ll[s]["wall"]:
                ratios[s] = {
                    "aggregate": ms[s]["aggregate"] / ll[s]["aggregate"],
                    "wall": ms[s]["wall"] / ll[s]["wall"],
                }
                print(f"{'':24} | {s:7} | {ratios[s]['aggregate']:9.2f} | {ratios[s]['wall']:4.2f}")
    return ratios


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", help="the GGUF file both servers load")
    p.add_argument(
        "--llama-server", default=None, help="llama-server binary (without it only moestream runs)"
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="compute threads (default: every CPU)")
    p.add_argument("--streams", default="1,4", help="concurrent requests to measure (comma-separated)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per request")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ctx", type=int, default=512, help="context tokens per slot")
    p.add_argument(
        "--moestream-args",
        default="",
        help='more `moestream serve` options, e.g. "--cache 2GiB" (one flag alone: --moestream-args=--flag)',
    )
    p.add_argument(
        "--llama-args", default="", help="more llama-server options (one flag alone: --llama-args=--flag)"
    )
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to load")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds one request may take")
    p.add_argument(
        "--memory-limit",
        type=parse_size,
        default=None,
        help="each server in a cgroup of its own limited to this (page cache included; root)",
    )
    p.add_argument(
        "--read-ahead", type=int, default=None, help="the file's disk read-ahead in KiB for the run (root)"
    )
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = p.parse_args()
    try:
        if args.memory_limit is not None:
            system.require_root("--memory-limit")
        if args.read_ahead is not None:
            system.require_root("--read-ahead")
    except MoestreamError as e:
        sys.exit(f"batch_servers.py: {e}")
    disk = system.device_for_path(args.file)
    if args.read_ahead is not None and disk is None:
        sys.exit(f"batch_servers.py: --read-ahead: {args.file} is not on a block device")
    streams = sorted({int(s) for s in args.streams.split(",")})
    slots = max(streams)
    if args.out:
        logs = Path(args.out).resolve().parent
        logs.mkdir(parents=True, exist_ok=True)
        stem = Path(args.out).stem
    else:
        logs, stem = Path(tempfile.mkdtemp(prefix="batch_servers-")), "batch_servers"
    # SIGTERM ends the run like Ctrl-C: the servers are stopped on the way out
    signal.signal(signal.SIGTERM, interrupted)
    print(
        f"{Path(args.file).name}: streams {streams} ({slots} slots of {args.ctx} tokens), "
        f"{args.tokens} tokens each, {args.threads} threads, median of {args.reps}; CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!s}",
        flush=True,
    )
    servers: dict[str, dict] = {}
    with contextlib.ExitStack() as changed:  # the read-ahead restored on every exit path
        if args.read_ahead is not None:
            changed.enter_context(system.readahead_set(disk, args.read_ahead))
        if args.llama_server:
            port = free_port()
            argv = llama_argv(args.llama_server, args.file, port, slots, args)
            servers["llama-server"] = measure(
                "llama-server", argv, port, logs / f"{stem}.llama-server.log", args, streams, disk
            )
        port = free_port()
        argv = moestream_argv(args.file, port, slots, args)
        servers["moestream"] = measure(
            "moestream", argv, port, logs / f"{stem}.moestream.log", args, streams, disk
        )
    ratios = table(servers, streams)
    if args.out:
        report = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "file": str(Path(args.file).resolve()),
            "options": {k: v for k, v in vars(args).items() if k != "out"},
            "streams": streams,
            "servers": servers,
            "ratios": ratios,
        }
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    if any("error" in entry for entry in servers.values()):
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the servers were stopped on the way out
        sys.exit("interrupted")

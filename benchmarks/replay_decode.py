"""End-to-end decode with learned routing at real expert size: `moestream generate --replay-routing`.

Each configuration (policy x prefetch mode) runs in a fresh process after the page cache is dropped
(when root), with direct I/O, on a synthetic checkpoint with the trace's layers, experts and top-k, and
the decode figures of all the trace's requests are summed. Rounds interleave the configurations, so
drift of the (virtual) disk hits them alike; ratios are against the first configuration in each round.

    .venv/bin/python benchmarks/replay_decode.py CHECKPOINT TRACE --slots 128 [--requests 4] \\
        [--policies lru,predictive] [--prefetch off,on,auto] [--rounds 2] [--threads N] \
        [--engine-args "--device cuda --gpu-cache 2GiB --host-cache 1GiB"]

`--slots` is the cache in expert slots (a share of the trace's experts: 128 of 512 = 25%).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path


def subset(trace: str, requests: int, out: Path) -> str:
    """The first `requests` requests of a moestream Parquet trace, header kept."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(trace)
    names = list(dict.fromkeys(table.column("request").to_pylist()))[:requests]
    pq.write_table(table.filter(pc.is_in(table.column("request"), value_set=pa.array(names))), out)
    return str(out)


def slot_bytes(checkpoint: str) -> int:
    import moestream

    with moestream.load(checkpoint, cache="64GiB", lock_memory=False) as engine:
        return engine.cache.slot_bytes


def run(
    checkpoint: str, trace: str, cache: int, policy: str, prefetch: str, threads: int | None, extra: list[str]
) -> dict:
    if os.geteuid() == 0:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    argv = [sys.executable, "-m", "moestream", "generate", checkpoint, "--replay-routing", trace, "--json"]
    argv += ["--cache", str(cache), "--policy", policy, "--prefetch", prefetch]
    if threads:
        argv += ["--threads", str(threads)]
    argv += extra
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    result = json.loads(out)
    d = result["stats"]["decode"]
    return {
        "policy": policy,
        "prefetch": prefetch,
        "decode_tok_s": d["tokens"] / d["seconds"],
        "decode_MiB_per_token": d["bytes_read"] / 2**20 / d["tokens"],
        "read_wait_ms_per_token": 1000 * d["read_wait_s"] / d["tokens"],
        "prefetches": d["prefetches"],
        "prefetch_used": d["prefetch_used"],
        "tokens": d["tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("trace")
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--requests", type=int, default=0, help="only the first N requests (0: all)")
    parser.add_argument("--policies", default="lru,predictive")
    parser.add_argument("--prefetch", default="off,on,auto")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--engine-args", default="", help="more `moestream generate` options, one string")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = subset(args.trace, args.requests, Path(tmp) / "t.parquet") if args.requests else args.trace
        cache = args.slots * slot_bytes(args.checkpoint)
        print(
            f"date {datetime.datetime.now().isoformat(timespec='seconds')}; {os.cpu_count()} cores; "
            f"cache {args.slots} slots = {cache} B; trace {args.trace} ({args.requests or 'all'} requests)"
        )
        configs = [(p, f) for p in args.policies.split(",") for f in args.prefetch.split(",")]
        for r in range(args.rounds):
            base = None
            for policy, prefetch in configs:
                extra = shlex.split(args.engine_args)
                row = run(args.checkpoint, trace, cache, policy, prefetch, args.threads, extra)
                base = base or row["decode_tok_s"]
                row["x_first"] = round(row["decode_tok_s"] / base, 3)
                row["round"] = r
                print(
                    json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                    flush=True,
                )


if __name__ == "__main__":
    main()

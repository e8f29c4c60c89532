"""How fast `moestream simulate` replays: (token, layer) rows per minute, per policy, on one core.

The trace is synthetic but shaped like the seed's model (Qwen3.6-35B-A3B: 40 MoE layers, 256 experts,
top-8, ~2 MiB per expert), 12 requests of 30 prompt tokens and ~2,050 decode tokens each, so about 1M
rows, with stale-gate predictions for lru-prefetch. Each policy replays the whole trace at one budget.

    .venv/bin/python benchmarks/simulator_speed.py [--requests 12] [--decode 2054] [--budget 2GiB] \
        [--save T.parquet]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

from moestream.trace.replay import build_replay, split_halves
from moestream.trace.simulator import POLICIES, capacity_for, run_policy
from moestream.trace.synthetic import random_trace
from moestream.units import MiB, parse_size


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=30)
    parser.add_argument("--decode", type=int, default=2054)
    parser.add_argument("--budget", default="2GiB")
    parser.add_argument("--policy", nargs="+", default=list(POLICIES))
    parser.add_argument(
        "--save", metavar="PARQUET", help="also write the trace, to time `moestream simulate` on it"
    )
    args = parser.parse_args()

    print(
        f"date {datetime.datetime.now().isoformat(timespec='seconds')}; {cpu_name()}, {os.cpu_count()} "
        "cores; "
        f"Python {platform.python_version()}"
    )
    t0 = time.perf_counter()
    trace = random_trace(
        n_layers=40,
        n_experts=256,
        top_k=8,
        n_requests=args.requests,
        prompt_len=args.prompt,
        decode_len=args.decode,
        seed=1,
        predictions=True,
        expert_bytes=2 * MiB,
    )
    t1 = time.perf_counter()
    if args.save:
        import pyarrow.parquet as pq

        pq.write_table(trace.to_table(), args.save, compression="zstd")
        t1 = time.perf_counter()
    replay = build_replay(trace, prefetch_top=8, uses=True)
    t2 = time.perf_counter()
    rows = len(trace)
    print(
        f"trace: {rows:,} (token, layer) rows, {len(replay):,} layer forwards; generated in {t1 - t0:.1f} s, "
        f"grouped into forwards in {t2 - t1:.1f} s ({rows / (t2 - t1) * 60 / 1e6:.1f} M rows/min)"
    )
    budget = parse_size(args.budget)
    capacity = capacity_for(budget, 2 * MiB)
    unit = [2 * MiB] * 40
    print(f"budget {args.budget} = {capacity} slots of 2 MiB")
    print(f"{'policy':<20}{'seconds':>9}{'M rows/min':>12}{'decode hit':>12}")
    for policy in args.policy:
        start = time.perf_counter()
        cells = run_policy(replay, policy, capacity, unit)
        took = time.perf_counter() - start
        hits, misses = cells[1].hits + cells[3].hits, cells[1].misses + cells[3].misses
        if policy == "static":  # replays the second half only: count the rows it actually replayed
            hits, misses = cells[3].hits, cells[3].misses
        replayed = rows if policy != "static" else int(split_halves(trace)[0].sum())
        print(f"{policy:<20}{took:>9.1f}{replayed / took * 60 / 1e6:>12.2f}{hits / (hits + misses):>12.1%}")


if __name__ == "__main__":
    main()

"""How fast `moestream simulate` replays: (token, layer) rows per minute, per policy, on one core.

The trace is synthetic but shaped like the seed's model (Qwen3.6-35B-A3B: 40 MoE layers, 256 experts,
top-8, ~2 MiB per expert), 12 requests of 30 prompt tokens and ~2,050 decode tokens each, so about 1M
rows, with stale-gate predictions for lru-prefetch. Each policy replays the whole trace at one budget.

    .venv/bin/python benchmarks/simulator_speed.py [--requests 12] [--decode 2054] [--budget 2GiB] \
        [--save T.parquet]

`--sweep N` times many budgets instead (`sweep`): N budgets on 4 requests of 30 + 595 tokens (100,000
rows) through `simulate` with LRU (one pass), the cost per budget of every policy, and N budgets with
every policy on a small trace (4 layers x 16 experts, top-2: `simulate` refuses no budget there, most
hold its whole working set).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import numpy as np

from moestream.trace.replay import Replay, build_replay, split_halves
from moestream.trace.simulator import POLICIES, capacity_for, run_capacities, run_policy, simulate
from moestream.trace.synthetic import random_trace
from moestream.trace.table import Trace
from moestream.units import MiB, format_size, parse_size


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


def seed_shaped(n_requests: int, decode: int, predictions: bool = True) -> Trace:
    """A synthetic trace shaped like the seed's model: 40 layers x 256 experts, top-8, 2 MiB experts."""
    return random_trace(
        n_layers=40,
        n_experts=256,
        top_k=8,
        n_requests=n_requests,
        prompt_len=30,
        decode_len=decode,
        seed=1,
        predictions=predictions,
        expert_bytes=2 * MiB,
    )


def sweep(n_budgets: int) -> None:
    """Many budgets: `simulate` with LRU over `n_budgets` budgets of a 100,000-row trace, the cost per
    budget of each policy, and every policy over `n_budgets` budgets of a small trace."""
    print(
        f"date {datetime.datetime.now().isoformat(timespec='seconds')}; {cpu_name()}, {os.cpu_count()} cores"
    )
    trace = seed_shaped(4, 595)  # 4 x (30 + 595) tokens x 40 layers = 100,000 rows
    keys = {(int(a), int(e)) for a, row in zip(trace.layer, trace.experts) for e in row}
    # evenly spaced from 8 slots to 1.5x the working set: nearly every budget a distinct capacity, the
    # hardest case for the one pass (a geometric spacing would repeat the small ones)
    budgets = [int(b) for b in np.linspace(16 * MiB, 3 * MiB * len(keys), n_budgets)]
    start = time.perf_counter()
    records, replay, _ = simulate(trace, ["lru"], budgets)
    took = time.perf_counter() - start
    above = sum(1 for b in budgets if b // (2 * MiB) >= len(keys))
    print(
        f"trace: {len(trace):,} rows, {len(replay):,} forwards, {len(keys):,} experts used; {n_budgets:,} "
        f"budgets 16 MiB..{format_size(budgets[-1])}, {above:,} of them hold every expert"
    )
    print(f"simulate, lru, {n_budgets:,} budgets: {took:.1f} s ({len(records):,} records)")
    per_budget(build_replay(trace, prefetch_top=8, uses=True), len(keys))
    small = random_trace(n_layers=4, n_experts=16, top_k=2, n_requests=2, predictions=True)
    small_budgets = [MiB * (1 + i) for i in range(n_budgets)]  # 1 MiB .. n MiB, slots of 1 MiB
    start = time.perf_counter()
    simulate(small, list(POLICIES), small_budgets)
    print(
        f"simulate, every policy, {n_budgets:,} budgets 1 MiB..{format_size(small_budgets[-1])} on a small "
        f"trace ({len(small):,} rows, 64 experts): {time.perf_counter() - start:.1f} s"
    )


def per_budget(replay: Replay, working_set: int, samples: int = 4) -> None:
    """Seconds per budget of each policy, over `samples` capacities below the working set (each policy
    as the simulator runs it: LRU and the predictive ones several capacities at once), against LRU
    replayed one budget at a time through `ResidentSet` (`run_policy`)."""
    capacities = [working_set * (i + 1) // (samples + 1) for i in range(samples)]
    unit = [2 * MiB] * 40
    start = time.perf_counter()
    for capacity in capacities:
        run_policy(replay, "lru", capacity, unit)
    lru = (time.perf_counter() - start) / samples
    print(f"seconds per budget ({samples} budgets of {capacities[0]}..{capacities[-1]} slots):")
    print(f"  {'lru, one budget at a time':<28}{lru:>8.2f}   1.0x")
    for policy in POLICIES:
        start = time.perf_counter()
        run_capacities(replay, policy, capacities, unit)
        each = (time.perf_counter() - start) / samples
        name = f"{policy} (one pass)" if policy == "lru" else policy
        print(f"  {name:<28}{each:>8.2f} {each / lru:>5.1f}x")


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
    parser.add_argument("--sweep", type=int, metavar="N", help="time N budgets at once instead (see above)")
    args = parser.parse_args()
    if args.sweep:
        sweep(args.sweep)
        return

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

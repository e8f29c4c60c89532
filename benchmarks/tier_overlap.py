"""Do a GPU tier's copies and the CPU's share of a layer's misses run at the same time? (issue 31 item 5:
the way "split" copies a share of a layer's misses while the CPU computes the rest, and its steps were
slower than either way alone on the H100: 17.8 ms against upload's 15.5 and host's 19.5 on 12-06 late.)

Loads MODEL with a GPU tier over a host cache that holds every expert (the ways' regime), decodes a few
tokens to warm it, then, for one MoE layer, times three things the way the tier's step runs them
(`TieredSteps._upload` and `_host_pairs`, with the CPU pool held as a step holds it):

  copy  --copies experts copied into device slots (each kind of each), then the wait for them;
  cpu   the CPU graph of --cpu misses of one token (`HostMisses`: their slots read in place);
  both  the copies issued, the CPU's graph, then the wait: what one layer of the way "split" does.

`issue` is the copies' issuing alone (before the wait): near `copy` where a copy returns only once its
bytes have left (from pageable memory: `pinned` says how many of the host cache's slot regions the
device page-locked).

Each repeat takes other experts (round robin over the layer's), so that the CPU reads them from RAM, not
from its caches. `overlap` is the share of the shorter of copy and cpu hidden in both:
(copy + cpu - both) / min(copy, cpu): 1 where they run side by side, 0 where one waits for the other.
The copies overwrite device slots of the tier: the engine is closed after, not used again.

    python benchmarks/tier_overlap.py MODEL --gpu-tier 2GiB [--copies 4] [--cpu 4] [--threads 8]
        [--backend cuda] [--repeats 40] [--cache 12GiB]

On ggml's CPU backend (--backend cpu, the 2-core stand-in) a copy is a memcpy on the calling thread:
nothing overlaps there, and the script only checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

import moestream
from moestream import ggml


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--gpu-tier", default="2GiB")
    p.add_argument("--cache", default=None, help="the host cache (default: auto; it must hold every expert)")
    p.add_argument("--copies", type=int, default=4, help="experts copied a layer")
    p.add_argument("--cpu", type=int, default=4, help="misses the CPU computes a layer")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--layer", type=int, default=None, help="a MoE layer (default: the first)")
    args = p.parse_args()
    if args.copies < 1 or args.cpu < 1 or args.repeats < 1:
        raise SystemExit("--copies, --cpu and --repeats must be at least 1")
    os.environ["MOESTREAM_GGML_BACKEND"] = args.backend
    os.environ["MOESTREAM_TIER_MISSES"] = "split"
    options = dict(trunk="ggml", threads=args.threads, gpu_tier=args.gpu_tier)
    if args.cache:
        options["cache"] = args.cache
    with moestream.load(args.model, **options) as engine:
        print(engine.mode_line(), flush=True)
        engine.generate([5, 17, 33, 2, 99, 41, 7, 250], max_tokens=8, ignore_eos=True)  # warm: tier, graphs
        steps = engine.runner.tiered
        if steps is None:
            raise SystemExit("no GPU tier was made (--gpu-tier, and ggml's graphs on a backend)")
        first = steps.experts.resident_slots()
        if first is None:
            raise SystemExit("the host cache does not hold every expert in place: give a larger --cache")
        tier, _ = steps.tier()
        moe = sorted(first)
        layer = moe[0] if args.layer is None else args.layer
        if layer not in first:
            raise SystemExit(f"--layer {layer} is not a MoE layer ({moe[0]}-{moe[-1]})")
        n = steps.experts.num_experts
        if args.copies + args.cpu > n:
            raise SystemExit(f"--copies + --cpu must not exceed the layer's {n} experts")
        slots = tier.types[layer].arena.slots  # the layer's class's device slots
        if args.copies > slots:
            raise SystemExit(f"--copies must not exceed the layer's {slots} device slots")
        kinds = tuple(tier.types[layer].arena.address)
        base, sync = first[layer], steps.memory.backend.synchronize
        graphs = steps._graphs()
        x = np.random.default_rng(0).standard_normal((1, steps.spec.hidden)).astype(np.float32)
        tokens = np.zeros(args.cpu, dtype=np.int64)
        copied_bytes = []
        kern = ggml.kernels(args.threads)
        turn = 0

        def pick(count: int) -> list[int]:
            nonlocal turn
            out = [(turn + j) % n for j in range(count)]
            turn = (turn + count) % n
            return out

        def copy(experts: list[int]) -> None:
            before = tier.counters.bytes_uploaded
            for j, e in enumerate(experts):
                tier.upload(layer, j, kinds, base + e)
            copied_bytes.append(tier.counters.bytes_uploaded - before)

        def cpu(experts: list[int]) -> None:
            graphs.compute(layer, x, tokens, [base + e for e in experts], experts)

        times: dict[str, list[float]] = {"copy": [], "cpu": [], "both": [], "issue": []}
        with kern._lock, kern.hold():  # as a step on a backend holds the pool (its workers poll)
            for _ in range(args.repeats):
                on, off = pick(args.copies), pick(args.cpu)
                t0 = time.perf_counter()
                copy(on)
                ti = time.perf_counter()
                sync()
                t1 = time.perf_counter()
                cpu(off)
                t2 = time.perf_counter()
                on, off = pick(args.copies), pick(args.cpu)
                t3 = time.perf_counter()
                copy(on)
                cpu(off)
                sync()
                t4 = time.perf_counter()
                times["copy"].append(t1 - t0)
                times["cpu"].append(t2 - t1)
                times["both"].append(t4 - t3)
                times["issue"].append(ti - t0)
        ms = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
        shorter = min(ms["copy"], ms["cpu"])
        # the host slots page-locked for the device (`pin_host`): else a copy from pageable memory may
        # return only once its bytes are staged, and nothing after it in the step runs meanwhile
        pinned = [(b, nb) in steps.memory._pinned for b, nb in steps.experts.slot_regions()]
        row = {
            "layer": layer,
            "copies": args.copies,
            "cpu_misses": args.cpu,
            "threads": args.threads,
            "backend": args.backend,
            "repeats": args.repeats,
            "median_ms": ms,
            "serial_ms": round(ms["copy"] + ms["cpu"], 3),
            "overlap": round((ms["copy"] + ms["cpu"] - ms["both"]) / shorter, 3) if shorter > 0 else None,
            "pinned": f"{sum(pinned)}/{len(pinned)}",
            "copy_gib_s": round(copied_bytes[0] / 2**30 / (ms["copy"] / 1e3), 2) if ms["copy"] else None,
            "cpu_us_per_miss": round(1e3 * ms["cpu"] / args.cpu, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Raw O_DIRECT read bandwidth of the disk holding a checkpoint: the ceiling for miss-bound decode.

Reads randomly chosen routed experts of the checkpoint (whole experts, as the cache does) in pieces of
the same size with the same number of threads, through plain `os.preadv` on O_DIRECT descriptors.
No cache, no compute: what the disk gives to this access pattern.

    python benchmarks/io_ceiling.py CHECKPOINT [--piece 128KiB] [--threads 4] [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import threading
import time

from moestream.model.arch import arch_for, num_experts
from moestream.store.source import open_source
from moestream.units import parse_size


def expert_ranges(path: str) -> list[tuple[str, int, int]]:
    """(file, aligned offset, aligned length) of every part of every routed expert."""
    source = open_source(path)
    config = source.config()
    emap = source.expert_map(arch_for(config).family, num_experts(config))
    ranges = []
    for parts in emap.units.values():
        for refs in parts.values():
            for ref in refs:
                start = ref.offset - ref.offset % 4096
                ranges.append((ref.file, start, -(-(ref.end - start) // 4096) * 4096))
    return ranges


def measure(ranges, piece: int, threads: int, seconds: float, seed: int = 0) -> dict:
    """Each thread reads whole random experts back to back, one `piece` per preadv (queue depth = threads)."""
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in {r[0] for r in ranges}}
    sizes = {f: os.fstat(fd).st_size for f, fd in fds.items()}
    totals = [0] * threads
    deadline = time.perf_counter() + seconds

    def reader(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        view = memoryview(mmap.mmap(-1, piece))
        while time.perf_counter() < deadline:
            file, start, length = rng.choice(ranges)
            fd, length = fds[file], min(length, sizes[file] - start) // 4096 * 4096
            for off in range(0, length, piece):
                totals[i] += os.preadv(fd, [view[: min(piece, length - off)]], start + off)

    began = time.perf_counter()
    workers = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - began
    for fd in fds.values():
        os.close(fd)
    total = sum(totals)
    return {
        "bytes": total,
        "seconds": elapsed,
        "gib_s": total / elapsed / (1 << 30),
        "piece": piece,
        "threads": threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--piece", default="128KiB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(expert_ranges(args.checkpoint), parse_size(args.piece), args.threads, args.seconds)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"O_DIRECT ceiling: {result['gib_s']:.3f} GiB/s ({result['bytes'] / 2**30:.2f} GiB in "
            f"{result['seconds']:.1f} s, {args.piece} pieces, {args.threads} threads)"
        )


if __name__ == "__main__":
    main()

"""CPU and wall seconds of `moestream.load` + close, after one warm-up load, averaged over `--repeats`.

    python benchmarks/load_time.py CHECKPOINT [CHECKPOINT ...] [--repeats 3] [--cache 64MiB]

Run it against two trees alternately with PYTHONPATH=<tree> to compare them.
"""

from __future__ import annotations

import argparse
import time

import moestream


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", default="64MiB")
    a = p.parse_args()
    for path in a.checkpoints:
        moestream.load(path, cache=a.cache).close()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(a.repeats):
            moestream.load(path, cache=a.cache).close()
        cpu, wall = (time.process_time() - cpu) / a.repeats, (time.perf_counter() - wall) / a.repeats
        print(f"{path}: load {cpu:.3f} s CPU, {wall:.3f} s wall")


if __name__ == "__main__":
    main()

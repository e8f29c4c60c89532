"""Prefill in-process, per prompt length: wall tok/s (the engine's prefill stats) and the process's CPU
time per prompt, which a shared machine disturbs far less than the wall clock at 1 thread.

    python benchmarks/prefill_cpu.py MODEL --threads 1 --lengths 20,64,256,512 --repeats 5 [--cache 4GiB]

Each length runs once unmeasured (it builds that shape's graph set), then `--repeats` times with other
token ids. Compare with `llama-bench -m MODEL -t N -p 20,64,256,512 -n 0 -r 5`, run alternately.
"""

from __future__ import annotations

import argparse
import statistics
import time

import moestream
from moestream.engine.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", default="20,64,256,512")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cache", default="4GiB")
    a = p.parse_args()
    with moestream.load(a.model, threads=a.threads, cache=a.cache) as engine:
        for n in (int(x) for x in a.lengths.split(",")):
            cpu, wall = [], []
            for r in range(a.repeats + 1):
                ids = list(range(100 + r, 100 + r + n))
                start = time.process_time()
                gen = engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))
                if r:  # the first builds the graph set
                    cpu.append(time.process_time() - start)
                    wall.append(gen.stats.prefill.seconds)
            c, w = statistics.median(cpu), statistics.median(wall)
            print(
                f"pp{n}: wall {n / w:.1f} tok/s [{n / max(wall):.1f}-{n / min(wall):.1f}]; "
                f"cpu {c * 1000:.1f} ms a prompt ({n / c:.1f} tok/s of CPU time)",
                flush=True,
            )


if __name__ == "__main__":
    main()

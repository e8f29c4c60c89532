"""Requests replacing each other in the slots (issue 33): 16 prompts through 4 slots, 32 greedy tokens
each, so a decode step's row count stays near 4 while the slots it uses change; the wall time, and the
step graphs built (each a `GraphSet.whole_graph` build: every expert cached) and their seconds.

    PYTHONPATH=$PWD python benchmarks/batch_churn.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch import FIXTURE, PROMPTS

import moestream
from moestream.graphs import graph_set


def main() -> None:
    built = [0, 0.0]
    whole_graph = graph_set.GraphSet.whole_graph

    def counted(self, whole):
        new = self.whole is None or self.whole[0] != whole
        start = time.perf_counter()
        net = whole_graph(self, whole)
        if new:
            built[0] += 1
            built[1] += time.perf_counter() - start
        return net

    graph_set.GraphSet.whole_graph = counted
    with moestream.load(str(FIXTURE), cache="1GiB", threads=2, parallel=4) as engine:
        engine.generate_batch(PROMPTS[:16], max_tokens=8, ignore_eos=True)  # warm-up
        built[:] = [0, 0.0]
        start = time.perf_counter()
        gens = engine.generate_batch(PROMPTS[:16], max_tokens=32, ignore_eos=True)
        wall = time.perf_counter() - start
    print(
        f"16 requests of 32 tokens, 4 slots: wall {wall:.3f} s, "
        f"{sum(len(g.tokens) for g in gens) / wall:.0f} "
        f"tok/s, step graphs built {built[0]} ({built[1]:.3f} s)"
    )


if __name__ == "__main__":
    main()

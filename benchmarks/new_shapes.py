"""What a prompt of a new length costs the ggml graphs: requests whose prompts have lengths 4..11 (each a
new prefill shape, a graph set built for it), 1 token each; wall and process CPU ms of all of them, and
the part spent building graph sets and whole-step graphs (timed by wrapping the two methods).

    python benchmarks/new_shapes.py MODEL [--threads 1] [--cache auto]

Run it against two trees alternately with PYTHONPATH=<tree> to compare them.
"""

from __future__ import annotations

import argparse
import time

import moestream
from moestream.graphs import graph_set


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default="auto")
    a = p.parse_args()
    spent = {"sets": 0.0, "whole": 0.0}
    init, whole = graph_set.GraphSet.__init__, graph_set.GraphSet.whole_graph

    def timed_init(self, *args, **kwargs):
        start = time.perf_counter()
        init(self, *args, **kwargs)
        spent["sets"] += time.perf_counter() - start

    def timed_whole(self, *args, **kwargs):
        start = time.perf_counter()
        out = whole(self, *args, **kwargs)
        spent["whole"] += time.perf_counter() - start
        return out

    graph_set.GraphSet.__init__, graph_set.GraphSet.whole_graph = timed_init, timed_whole
    with moestream.load(a.model, cache=a.cache, threads=a.threads) as engine:
        print(engine.mode_line())
        engine.generate([5, 6, 7], max_tokens=2, ignore_eos=True)
        spent.update(sets=0.0, whole=0.0)
        wall, cpu = time.perf_counter(), time.process_time()
        for n in range(4, 12):
            engine.generate([(7 * i + 3) % 500 + 5 for i in range(n)], max_tokens=1, ignore_eos=True)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(
        f"8 requests {wall * 1e3:.0f} ms wall, {cpu * 1e3:.0f} ms CPU; graph sets built in "
        f"{spent['sets'] * 1e3:.0f} ms, whole-step graphs in {spent['whole'] * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()

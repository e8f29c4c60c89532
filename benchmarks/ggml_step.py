"""The ggml runner's step, measured in-process: decode ms/token split into the time inside ggml graph
computes and the time outside them (Python, the expert cache, torch glue), and warm prefill tok/s.

    python benchmarks/ggml_step.py MODEL --threads 1 [--cache 4GiB] [--tokens 32] [--prompt 64]

Every expert is read before the measured steps (a warm-up generation), so this is compute only when
`--cache` holds them all. Compare with `llama-bench -m MODEL -t N -p 64 -n 32` on the same GGUF.
"""

from __future__ import annotations

import argparse
import time

import moestream
from moestream.ggml import net


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--cache", default="4GiB")
    p.add_argument("--tokens", type=int, default=32, help="decode steps measured")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of the prefill measured")
    args = p.parse_args()
    inside = [0.0]
    run = net.Net.run

    def timed(self: net.Net) -> None:
        t = time.perf_counter()
        run(self)
        inside[0] += time.perf_counter() - t

    net.Net.run = timed
    with moestream.load(args.model, cache=args.cache, threads=args.threads, trunk="ggml") as engine:
        print(engine.mode_line())
        ids = list(range(100, 100 + args.prompt))
        engine.generate(ids, max_tokens=4, ignore_eos=True)  # every expert this prompt uses is read
        step = engine.runner
        for _ in range(2):
            t0 = time.perf_counter()
            logits, kv = step(ids, None)
            print(f"prefill {len(ids)} tokens: {len(ids) / (time.perf_counter() - t0):.1f} tok/s")
        inside[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            logits, kv = step([int(logits.argmax())], kv)
        ms = (time.perf_counter() - t0) / args.tokens * 1e3
        graphs = inside[0] / args.tokens * 1e3
        print(
            f"decode t={args.threads}: {ms:.2f} ms/token ({1e3 / ms:.1f} tok/s); inside ggml graphs "
            f"{graphs:.2f} ms, outside {ms - graphs:.2f} ms; hits {engine.cache.stats.hits} misses "
            f"{engine.cache.stats.misses}"
        )


if __name__ == "__main__":
    main()

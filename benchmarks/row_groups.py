"""What the 7-row rule costs a batched decode step (issue 33, item 3; `moestream.ggml.tiled`): the runner's
steps of N rows with the rule and without it (ggml's tiled kernel then takes 8 rows or more of a K-quant
matrix), alternated in one process, so that a shared machine's load falls on both alike.

    python benchmarks/row_groups.py MODEL.gguf [--streams 8,16] [--steps 16] [--rounds 5]
                                    [--cache 4GiB] [--threads 2] [--ways rule,tiled]

The N prompts (`benchmarks/batch.py`'s) are prefilled once in N slots; then each round, for each way
(MOESTREAM_GGML_BATCH_GROUPS=1 or 0, the graph sets built again), `--steps` steps of N rows from the same
positions, each row fed its argmax (no sampling, threads or rounds: `batch.py`'s "runner steps alone"),
after one untimed step. Per N and way: the median over rounds of tok/s (wall) and of process CPU ms
per token, and the median of each round's rate over the first way's. With GGML_CPU_TILED_MM=0 in the
environment (ggml's switch, read once a process: no tiled kernel at all) run it with `--ways rule` (the
rule then changes nothing) and compare across processes. Also says whether each way's tokens after
the steps are those of the first way (the rule's are each sequence's alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from batch import PROMPTS

import moestream
from moestream.ggml import tiled

WAYS = {"rule": "1", "tiled": "0"}


def steps(runner, seqs, first: list[int], start: list[int], n: int) -> tuple[float, float, list[int]]:
    """`n` steps of len(seqs) rows from `start` positions and tokens `first`: (wall s, CPU s, the tokens)."""
    for kv, s in zip(seqs, start):
        kv.tokens = s
    rows = first
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        rows = runner.decode(list(zip(seqs, rows))).argmax(dim=-1).tolist()
    return time.perf_counter() - wall, time.process_time() - cpu, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--streams", default="8,16")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cache", default="4GiB")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ways", default="rule,tiled")
    args = p.parse_args()
    streams = [int(x) for x in args.streams.split(",")]
    ways = args.ways.split(",")
    tiled_env = os.environ.get("GGML_CPU_TILED_MM", "1")
    options = dict(cache=args.cache, threads=args.threads, trunk="ggml", parallel=max(streams))
    with moestream.load(args.path, **options) as engine, torch.inference_mode():
        runner = engine.runner
        print(engine.mode_line())
        print(f"GGML_CPU_TILED_MM={tiled_env}, the tiled kernel taken from 8 rows: {tiled.tiled_kernel()}")
        print("streams | way | tok/s (median) | CPU ms/token (median) | rate / first way's (median) | tokens")
        for n in streams:
            seqs = runner.seqs[:n]
            first, start = [], []
            for kv, prompt in zip(seqs, PROMPTS):
                kv.tokens = 0
                first.append(int(runner(engine.encode(prompt), kv)[0].argmax()))
                start.append(kv.tokens)
            rates: dict[str, list[float]] = {w: [] for w in ways}
            cpu: dict[str, list[float]] = {w: [] for w in ways}
            tokens: dict[str, list[int]] = {}
            for _ in range(args.rounds):
                for way in ways:
                    os.environ[tiled.GROUPS_ENV] = WAYS[way]
                    runner.close_sets()  # built again under this way
                    steps(runner, seqs, first, start, 1)
                    wall, used, tokens[way] = steps(runner, seqs, first, start, args.steps)
                    rates[way].append(n * args.steps / wall)
                    cpu[way].append(used / (n * args.steps) * 1e3)
            for way in ways:
                ratio = statistics.median(a / b for a, b in zip(rates[way], rates[ways[0]]))
                same = "the same" if tokens[way] == tokens[ways[0]] else "other"
                print(
                    f"{n:7d} | {way:5s} | {statistics.median(rates[way]):14.1f} | "
                    f"{statistics.median(cpu[way]):21.2f} | {ratio:27.3f} | {same}"
                )


if __name__ == "__main__":
    main()

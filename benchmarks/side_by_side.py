"""Prompts that arrive together, fed side by side or one after the other (issue 33): a round's steps a
layer at a time (`GgmlRunner.together`, the default where experts stream on the host) against the same
steps in turn (the runner's `lockstep` answered False), on an expert cache that holds fewer experts than
the model has.

    python benchmarks/side_by_side.py MODEL.gguf [--cache 3400MiB] [--prompts 25,23,17,38] [--tokens 1]
                                      [--threads N] [--reps 2]

Each run loads the model afresh (an empty cache), lets N requests take their slots together (a barrier
in `Batcher.acquire`, so that one round feeds every prompt: the prompts' lengths sum to at most one
chunk), generates `--tokens` greedy tokens each through `Engine.generate_batch`, and reports the wall
time, the experts' bytes read and misses, and the rounds run side by side. The ways alternate (side by
side, in turn, ...) `--reps` times; the tokens must be the same in every run. Prompt token ids are
fixed pseudo-random ids below the vocabulary's size.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import threading
import time

import moestream
from moestream.engine.sampling import SamplingParams


def prompts_of(lengths: list[int], vocab: int) -> list[list[int]]:
    return [[3 + (i * 7919 + j * 104729) % (vocab - 3) for j in range(n)] for i, n in enumerate(lengths)]


def run(path: str, way: str, lengths: list[int], args: argparse.Namespace) -> dict:
    with moestream.load(path, cache=args.cache, parallel=len(lengths), threads=args.threads) as engine:
        if way == "in turn":
            engine.runner.lockstep = lambda: False
        barrier, acquire = threading.Barrier(len(lengths), timeout=3600), engine.batch.acquire

        def acquired(ids: list[int]) -> int:
            slot = acquire(ids)
            barrier.wait()
            return slot

        engine.batch.acquire = acquired
        prompts = prompts_of(lengths, engine.runner.spec.vocab)
        before, start = engine.counters(), time.perf_counter()
        gens = engine.generate_batch(prompts, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
        seconds, after = time.perf_counter() - start, engine.counters()
        return {
            "way": way,
            "seconds": seconds,
            "gib_read": (after.bytes_read - before.bytes_read) / 2**30,
            "misses": after.misses - before.misses,
            "side_by_side_rounds": engine.batch.together_rounds,
            "rounds": engine.batch.rounds,
            "tokens": [g.tokens for g in gens],
            "mode": engine.mode_line(),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--cache", default="3400MiB")
    p.add_argument("--prompts", default="25,23,17,38", help="the prompts' lengths in tokens")
    p.add_argument("--tokens", type=int, default=1, help="greedy tokens a request")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    lengths = [int(n) for n in args.prompts.split(",")]
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC | {platform.node()} | {args.model}")
    runs = []
    for rep in range(args.reps):
        for way in ("side by side", "in turn"):
            r = run(args.model, way, lengths, args)
            if rep == 0 and way == "side by side":
                print(r["mode"])
            runs.append(r)
            print(
                f"{way:12s} | {r['seconds']:6.1f} s | {r['gib_read']:6.2f} GiB read | "
                f"{r['misses']:6d} misses | {r['side_by_side_rounds']} of {r['rounds']} rounds side by side",
                flush=True,
            )
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    med = {
        way: (
            statistics.median(r["seconds"] for r in runs if r["way"] == way),
            statistics.median(r["gib_read"] for r in runs if r["way"] == way),
        )
        for way in ("side by side", "in turn")
    }
    (s, sg), (t, tg) = med["side by side"], med["in turn"]
    print(f"median: side by side {s:.1f} s, {sg:.2f} GiB; in turn {t:.1f} s, {tg:.2f} GiB")
    print(f"in turn / side by side: time {t / s:.2f}x, bytes {tg / sg:.2f}x; ", end="")
    print(f"the same tokens in every run: {same}")
    if not same:
        raise SystemExit("the tokens differ between runs")


if __name__ == "__main__":
    main()

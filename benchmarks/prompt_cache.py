"""Prompt cache A/B: a chat's second turn with and without the prompt cache, side by side in one process.

    python benchmarks/prompt_cache.py CHECKPOINT [--cache 128MiB] [--reps 3] [--history 1] [--threads N]

Each repetition runs turn 1 (a long user message: `--history` times the text below; 32 tokens generated),
then turn 2 (turn 1, its reply and a short follow-up) with the cache, then turn 1 again (so that the
expert cache starts from the same state) and turn 2 without it. Per turn 2: prompt tokens computed and
reused, prefill seconds, expert MiB read during prefill, decode tok/s, and whether both runs generated
the same tokens.
"""

from __future__ import annotations

import argparse
import statistics

import moestream

LONG = (
    "I am planning a two-week trip through the mountains in late autumn and would like advice on what to "
    "pack, how to plan the daily distances, which kind of shoes work best on wet rocky paths, how to keep "
    "food fresh without a fridge, and what to do if the weather suddenly turns bad high above the valley. "
    "I will be walking alone, carrying a small tent, and I can resupply in a village every four days. "
    "Please also tell me how to read the local trail markings and how early I should start each morning."
)
FOLLOW = "Thanks. And which of these matters most if I only have a week?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--cache", default="128MiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--history", type=int, default=1, help="repeat the first message this many times")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    turn1 = [{"role": "user", "content": " ".join([LONG] * args.history)}]
    rows: dict[str, list] = {"with cache": [], "without": []}
    with moestream.load(args.path, cache=args.cache, threads=args.threads) as engine:
        print(engine.mode_line())
        for _ in range(args.reps):
            first = engine.generate(messages=turn1, max_tokens=32, ignore_eos=True, cache_prompt=True)
            turn2 = [
                *turn1,
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": FOLLOW},
            ]
            warm = engine.generate(messages=turn2, max_tokens=16, ignore_eos=True, cache_prompt=True)
            engine.generate(messages=turn1, max_tokens=32, ignore_eos=True, cache_prompt=True)
            cold = engine.generate(messages=turn2, max_tokens=16, ignore_eos=True)
            rows["with cache"].append(warm)
            rows["without"].append(cold)
            assert warm.tokens == cold.tokens, "the prompt cache changed the output"
    print("turn 2 | prompt tokens computed (reused) | prefill s (median) | prefill MiB read | decode tok/s")
    for label, gens in rows.items():
        g = gens[0]
        prefill = statistics.median(x.stats.prefill.seconds for x in gens)
        mib = statistics.median(x.stats.prefill.bytes_read for x in gens) / (1 << 20)
        decode = statistics.median(x.stats.decode.tok_s for x in gens)
        print(
            f"{label} | {g.stats.prefill.tokens} ({g.cached_tokens}) of {g.prompt_tokens} | {prefill:.3f} | "
            f"{mib:.1f} | {decode:.2f}"
        )
    warm_s = statistics.median(x.stats.prefill.seconds for x in rows["with cache"])
    cold_s = statistics.median(x.stats.prefill.seconds for x in rows["without"])
    print(
        f"prefill time ratio without/with: {cold_s / warm_s:.2f}x; identical tokens in all {args.reps} pairs"
    )


if __name__ == "__main__":
    main()

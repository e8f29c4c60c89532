"""Decode speed of two source trees of moestream side by side: the same `generate` command, alternated.

For a change that must not change speed (a refactor): each round runs the command once with tree A's
package and once with tree B's (order alternating between rounds), the page cache dropped before each
run, and reports decode/prefill tok/s, MiB read per decoded token and the B/A ratio per round.

    python benchmarks/ab_trees.py --a /work/wt/base --b . --rounds 3 -- CHECKPOINT --cache 1GiB \
        --max-tokens 32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from moestream.bench.system import drop_caches

PROMPT = "The history of the printing press shows how a new machine can change the way people"


def run(tree: Path, generate_args: list[str]) -> dict:
    drop_caches()
    argv = [
        sys.executable,
        "-m",
        "moestream",
        "generate",
        *generate_args,
        "--prompt",
        PROMPT,
        "--ignore-eos",
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tree, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: generate failed ({proc.returncode})\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "decode_tok_s": out["stats"]["decode_tok_s"],
        "prefill_tok_s": out["stats"]["prefill_tok_s"],
        "mib_per_token": out["stats"]["mib_per_token"],
        "tokens": out["tokens"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="source tree A (the before)")
    parser.add_argument("--b", type=Path, required=True, help="source tree B (the after)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("generate_args", nargs=argparse.REMAINDER, help="-- then `moestream generate` args")
    args = parser.parse_args()
    gen_args = [a for a in args.generate_args if a != "--"]
    print(f"date {time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} cores; generate {' '.join(gen_args)}")
    print(
        "| round | order | A decode tok/s | B decode tok/s | B/A | A prefill | B prefill | MiB/token A, B |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for i in range(args.rounds):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        res = {side: run(args.a if side == "a" else args.b, gen_args) for side in order}
        a, b = res["a"], res["b"]
        if a["tokens"] != b["tokens"]:
            raise SystemExit(f"round {i + 1}: the two trees generated different tokens")
        ratios.append(b["decode_tok_s"] / a["decode_tok_s"])
        print(
            f"| {i + 1} | {'->'.join(order).upper()} | {a['decode_tok_s']:.2f} | {b['decode_tok_s']:.2f} | "
            f"{ratios[-1]:.3f} | {a['prefill_tok_s']:.2f} | {b['prefill_tok_s']:.2f} | "
            f"{a['mib_per_token']:.1f}, {b['mib_per_token']:.1f} |",
            flush=True,
        )
    print(f"median B/A decode {statistics.median(ratios):.3f}; identical tokens in every run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

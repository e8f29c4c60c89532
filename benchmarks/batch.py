"""Several requests at once (issue 33): aggregate decode tok/s and expert bytes read per generated token at
1, 2, 4 and 8 concurrent streams, every expert in RAM and streamed from disk under a cache budget, in one
process; and whether each stream's greedy tokens beside the others are its tokens alone.

    python benchmarks/batch.py [MODEL] [--streams 1,2,4,8] [--tokens 64] [--budgets 1GiB,24MiB,12MiB]
                               [--threads N] [--reps 3] [--exact 16] [--io-mode direct]

MODEL defaults to the trained fixture (`../shared/fixtures/stdlib-moe-8x64`: learned routing). Per budget
the model is loaded once with `parallel` = the most streams (a KV-cache slot each); each run sends N
distinct code prompts at once through `Engine.generate_batch` (greedy, EOS ignored, `--tokens` each) and
reports, median over `--reps`: the aggregate decode rate (the sum of each stream's decode tok/s: they run
side by side from first token to last), the wall rate (every generated token over the run's wall time,
prefill included), expert MiB read per generated token (the run's reads over its tokens) and the mean
rows of a decode step; and the runner's decode steps alone (the same N prompts in N slots, a step of N
rows a token, each row fed its argmax: no sampling, threads or rounds), what the engine's per-request
work costs beside them. `--exact K`: K prompts run alone, then 8 at a time, `--tokens` greedy tokens each:
the share of continuations that are identical. `--stall P`: a P-token prompt joins a stream that is
decoding: how long the stream's tokens wait meanwhile (the prompt is fed a chunk a round).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

import moestream

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "stdlib-moe-8x64"
PROMPTS = [
    "def read_config(path):",
    "class LRUCache:\n    def __init__(self, capacity):",
    "import os\nimport sys\n\n\ndef main(argv):",
    "def _parse_header(line):\n    ",
    'class Queue(object):\n    """A FIFO queue."""\n',
    "    def close(self):\n        if self._closed:",
    "def quote(string, safe='/'):",
    "try:\n    import threading\nexcept ImportError:",
    'def isfile(path):\n    """Test whether a path is a regular file"""',
    "class HTTPResponse(io.BufferedIOBase):",
    "def encode(self, encoding='utf-8'):",
    "    for key, value in sorted(items):",
    "def walk(top, topdown=True, onerror=None):",
    "class Decimal(object):\n    __slots__ =",
    "def compile(pattern, flags=0):",
    '    raise ValueError("invalid literal for int()',
]


def run(engine, n: int, tokens: int) -> dict[str, float]:
    """N prompts at once: the figures of one run."""
    before = engine.counters()
    steps, rows = engine.batch.decode_steps, engine.batch.decode_rows
    start = time.perf_counter()
    gens = engine.generate_batch(PROMPTS[:n], max_tokens=tokens, ignore_eos=True)
    wall = time.perf_counter() - start
    read = engine.counters().bytes_read - before.bytes_read
    made = sum(len(g.tokens) for g in gens)
    steps, rows = engine.batch.decode_steps - steps, engine.batch.decode_rows - rows
    return {
        "runner": runner_rate(engine, n, tokens),
        "aggregate": sum(g.stats.decode.tok_s for g in gens),
        "wall": made / wall,
        "mib_per_token": read / made / (1 << 20),
        "rows": rows / steps if steps else 1.0,
    }


def runner_rate(engine, n: int, tokens: int) -> float:
    """Tokens a second of the runner's decode steps alone (no sampling, no threads, no rounds): the N
    prompts prefilled in N slots, then `tokens` steps of N rows, each row fed its own argmax."""
    runner = engine.runner
    seqs = runner.seqs[:n]
    rows = []
    with torch.inference_mode():
        for kv, prompt in zip(seqs, PROMPTS):
            kv.tokens = 0
            rows.append(int(runner(engine.encode(prompt), kv)[0].argmax()))
        start = time.perf_counter()
        for _ in range(tokens):
            logits = runner.decode(list(zip(seqs, rows)))
            rows = logits.argmax(dim=-1).tolist()
        return n * tokens / (time.perf_counter() - start)


def stall(engine, prompt_tokens: int) -> tuple[float, float, float]:
    """A stream decoding while a prompt of `prompt_tokens` joins: (its median gap between tokens before,
    its longest gap while the prompt was prefilled, the prompt's prefill seconds), in seconds."""
    joining = (engine.encode("\n".join(PROMPTS)) * (prompt_tokens // 8 + 1))[:prompt_tokens]
    stamps: list[float] = []
    ten = threading.Event()

    def running() -> None:
        for gen in engine.stream(PROMPTS[0], max_tokens=200, ignore_eos=True):
            stamps.append(time.perf_counter())
            if len(gen.tokens) == 10:
                ten.set()

    thread = threading.Thread(target=running)
    thread.start()
    ten.wait()
    start = time.perf_counter()
    prefill = engine.generate(joining, max_tokens=1, ignore_eos=True).stats.prefill.seconds
    thread.join()
    gaps = [(b, b - a) for a, b in itertools.pairwise(stamps)]
    before = statistics.median(g for t, g in gaps if t < start)
    during = max(g for t, g in gaps if start < t <= start + prefill + max(g for _, g in gaps))
    return before, during, prefill


def exact(engine, k: int, tokens: int, at_once: int) -> tuple[int, int]:
    """(identical continuations, prompts): `k` prompts alone, then `at_once` at a time."""
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(k)]
    alone = [engine.generate(p, max_tokens=tokens, ignore_eos=True).tokens for p in prompts]
    together = []
    for i in range(0, k, at_once):
        together += [
            g.tokens
            for g in engine.generate_batch(prompts[i : i + at_once], max_tokens=tokens, ignore_eos=True)
        ]
    return sum(a == b for a, b in zip(alone, together)), k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", nargs="?", default=str(FIXTURE))
    p.add_argument("--streams", default="1,2,4,8", help="concurrent streams to measure (comma-separated)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per stream")
    p.add_argument("--budgets", default="1GiB,24MiB,12MiB", help="expert cache budgets (comma-separated)")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: the physical cores)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--exact", type=int, default=16, help="prompts for the identical-continuations check (0: skip)"
    )
    p.add_argument("--io-mode", default="direct")
    p.add_argument(
        "--stall", type=int, default=1024, help="tokens of the prompt that joins a running stream (0: skip)"
    )
    args = p.parse_args()
    streams = [int(x) for x in args.streams.split(",")]
    if max(streams) > len(PROMPTS):
        p.error(f"at most {len(PROMPTS)} streams (one prompt each)")
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | {platform.node()} | "
        f"{platform.processor() or platform.machine()} | {args.path}"
    )
    for budget in args.budgets.split(","):
        kwargs = dict(cache=budget, threads=args.threads, io_mode=args.io_mode, parallel=max(max(streams), 2))
        with moestream.load(args.path, **kwargs) as engine:
            print(engine.mode_line())
            for n in streams:  # warm-up: every step shape's graphs built once
                run(engine, n, 8)
            print("streams | aggregate decode tok/s | vs 1 stream | wall tok/s (prefill incl.) | ", end="")
            print("MiB read/token | rows/step | runner steps alone tok/s | vs 1")
            base = None
            for n in streams:
                runs = [run(engine, n, args.tokens) for _ in range(args.reps)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                base = base or (med["aggregate"], med["runner"])
                print(
                    f"{n:7d} | {med['aggregate']:22.1f} | {med['aggregate'] / base[0]:10.2f}x | "
                    f"{med['wall']:25.1f} | {med['mib_per_token']:14.2f} | {med['rows']:9.2f} | "
                    f"{med['runner']:24.1f} | {med['runner'] / base[1]:.2f}x"
                )
            if args.stall:
                before, during, prefill = stall(engine, args.stall)
                print(
                    f"a {args.stall}-token prompt joining a running stream: its prefill {prefill:.2f} s; the "
                    f"stream's gap between tokens {1e3 * before:.1f} ms before, "
                    f"at most {1e3 * during:.1f} ms meanwhile"
                )
            if args.exact:
                side = engine.batch.together_rounds
                same, k = exact(engine, args.exact, args.tokens, max(streams))
                print(
                    f"identical {args.tokens}-token greedy continuations, alone vs {max(streams)} at once: "
                    f"{same}/{k} ({100 * same / k:.0f}%; {engine.batch.together_rounds - side} of the "
                    "rounds side by side)"
                )


if __name__ == "__main__":
    main()

"""What the shards' check after every forward costs per token (a checkpoint changed during a request).

    python benchmarks/checkpoint_check.py [CHECKPOINT] [--shards 1,5,16,163] [--tokens 32] [--rounds 6]

Part 1: `Reader.check_files` (an fstat of each open shard's descriptor and a stat of its path) with
1 to 163 shards open (Qwen3-30B-A3B has 16 shards, DeepSeek-V3 163): microseconds per call, which is
the cost per token (one call after each forward). The files are small: fstat and stat do not read data.
Part 2 (with CHECKPOINT): decode ms per token of one loaded engine, every expert cached, rounds
alternating the check on and off (`ExpertStreaming.checked` made a no-op), same tokens asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from moestream.io.reader import Reader


def check_us(shards: int, calls: int = 2000, repeats: int = 5) -> float:
    """Best of `repeats` means of `calls` check_files calls with `shards` files open, in microseconds."""
    with tempfile.TemporaryDirectory() as tmp:
        reader = Reader("pagecache", threads=1)
        try:
            for i in range(shards):
                path = Path(tmp) / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
                path.write_bytes(b"\0" * 4096)
                reader.open(str(path))
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(calls):
                    reader.check_files()
                best = min(best, (time.perf_counter() - start) / calls)
        finally:
            reader.close()
    return best * 1e6


def decode_ms(checkpoint: str, tokens: int, rounds: int) -> tuple[list[float], list[float], int]:
    """(ms/token with the check, ms/token without, shards) over alternating rounds of one engine."""
    import moestream
    from moestream.runtime.streaming import ExpertStreaming

    checked = ExpertStreaming.checked
    prompt = "def read_config(path):"
    on: list[float] = []
    off: list[float] = []
    with moestream.load(checkpoint, cache="4GiB", io_mode="direct") as engine:
        reference = engine.generate(prompt, max_tokens=tokens, ignore_eos=True).tokens  # warms the cache
        for r in range(2 * rounds):
            use = r % 2 == 0
            ExpertStreaming.checked = checked if use else lambda self, step: step
            try:
                gen = engine.generate(prompt, max_tokens=tokens, ignore_eos=True)
            finally:
                ExpertStreaming.checked = checked
            assert gen.tokens == reference
            (on if use else off).append(1000 * gen.stats.decode.seconds / gen.stats.decode.tokens)
        return on, off, len(engine.emap.files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", help="a checkpoint for the decode A/B (part 2)")
    p.add_argument("--shards", default="1,5,16,163", help="shard counts for part 1")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6, help="rounds with and rounds without the check")
    args = p.parse_args()
    for n in (int(s) for s in args.shards.split(",")):
        print(f"check_files, {n:3d} shards open: {check_us(n):7.1f} us per call (= per token)")
    if args.checkpoint:
        on, off, shards = decode_ms(args.checkpoint, args.tokens, args.rounds)
        print(
            f"decode, {shards} shards, {args.tokens} tokens x {args.rounds} rounds each: "
            f"check on {statistics.median(on):.2f} ms/token (min {min(on):.2f}), "
            f"off {statistics.median(off):.2f} ms/token (min {min(off):.2f}); same tokens"
        )


if __name__ == "__main__":
    main()

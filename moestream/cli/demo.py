"""`moestream demo`: synthesise a small MoE once, stream it through a cache much smaller than its experts,
run the same prompt with every expert resident, and show both runs side by side."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from moestream.errors import MoestreamError

DEMO_PROMPT = "The history of the printing press shows how a new machine can change"
MiB = 1 << 20


def default_dir() -> Path:
    root = os.environ.get("MOESTREAM_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "moestream")
    return Path(root) / "demo-qwen3moe"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="stream a synthetic MoE (made on first use) through a 128 MiB cache")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the synthetic checkpoint lives (default ~/.cache/moestream)",
    )
    p.add_argument("--cache", default="128MiB", help="expert cache budget (default 128MiB)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--io-mode", default="direct", choices=["direct", "pagecache", "mmap"])
    p.set_defaults(func=run)


def ensure_checkpoint(path: Path) -> Path:
    if (path / "moestream_synth.json").exists():
        return path
    from moestream.synth import synthesize

    print(f"moestream demo: writing a synthetic checkpoint to {path} (once)", flush=True)
    return synthesize(path, preset="demo", force=True)


def intro(engine: Any) -> str:
    """What the demo is and what it shows, before any number."""
    share = 100 * engine.cache.capacity / len(engine.emap.units)
    return (
        f"moestream demo: a synthetic {engine.config.model_type} with {len(engine.emap.units)} routed "
        f"experts "
        f"({engine.emap.expert_bytes / MiB:.0f} MiB) and RANDOM weights, so the text is noise by design.\n"
        f"What it shows: the experts stream from disk through a cache that holds {share:.0f}% of them, and "
        f"the tokens are exactly those of the run with every expert resident in memory."
    )


def row(label: str, cache: str, gen: Any) -> str:
    s = gen.stats
    return (
        f"{label:<10} {cache:<34} {s.decode.tok_s:>12.2f} {s.prefill.tok_s:>13.2f} "
        f"{s.bytes_read / MiB:>15.1f} {100 * s.hit_rate:>8.1f}%"
    )


def run(args: argparse.Namespace) -> int:
    import moestream

    path = ensure_checkpoint(args.dir or default_dir())
    with moestream.load(str(path), cache=args.cache, io_mode=args.io_mode) as engine:
        print(intro(engine))
        print(engine.mode_line())
        streamed = engine.generate(DEMO_PROMPT, max_tokens=args.max_tokens, ignore_eos=True)
        streamed_cache = f"{args.cache} = {engine.cache.capacity} slots"
        experts = len(engine.emap.units)
        # the same loaded model, its cache rebuilt to hold every expert; one run fills it, the next is timed
        engine.restream(cache=engine.cache.slot_bytes * experts)
        engine.generate(DEMO_PROMPT, max_tokens=args.max_tokens, ignore_eos=True)
        resident = engine.generate(DEMO_PROMPT, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"prompt: {DEMO_PROMPT!r}")
    print(f"text:   {streamed.text!r}")
    header = ("", "expert cache", "decode tok/s", "prefill tok/s", "MiB read", "hit rate")
    print("{:<10} {:<34} {:>12} {:>13} {:>15} {:>9}".format(*header))
    print(row("streamed", streamed_cache, streamed))
    print(row("resident", f"every expert ({experts} slots), warmed", resident))
    same = resident.tokens == streamed.tokens
    print(f"tokens: {'identical' if same else 'DIFFERENT'} ({len(streamed.tokens)} generated)")
    if not same:
        raise MoestreamError("streamed output differs from the fully resident output: please report this bug")
    return 0

"""`moestream demo`: synthesise a small MoE once, stream it through a cache much smaller than its experts,
check the streamed text against the fully resident run, and print the stats."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from moestream.errors import MoestreamError

DEMO_PROMPT = "The history of the printing press shows how a new machine can change"


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


def run(args: argparse.Namespace) -> int:
    import moestream

    path = ensure_checkpoint(args.dir or default_dir())
    with moestream.load(str(path), cache=args.cache, io_mode=args.io_mode) as engine:
        print(engine.mode_line())
        streamed = engine.generate(DEMO_PROMPT, max_tokens=args.max_tokens, ignore_eos=True)
        print(f"prompt: {DEMO_PROMPT!r}")
        print(f"text:   {streamed.text!r}")
        print(streamed.stats.line())
        all_experts = engine.cache.slot_bytes * len(engine.emap.units)
    with moestream.load(str(path), cache=all_experts, io_mode=args.io_mode) as resident:
        full = resident.generate(DEMO_PROMPT, max_tokens=args.max_tokens, ignore_eos=True)
    same = full.tokens == streamed.tokens
    print(
        f"fully resident run ({resident.cache.capacity} slots, every expert cached): "
        f"{'identical tokens' if same else 'DIFFERENT tokens'} ({len(full.tokens)} generated)"
    )
    if not same:
        raise MoestreamError("streamed output differs from the fully resident output: please report this bug")
    return 0

"""`moestream bench`: 12 real prompts against a server, the seed's measurement method (docs/bench.md)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moestream.cli._engine_args import add_engine_arguments, add_hf_argument
from moestream.errors import MoestreamError

if TYPE_CHECKING:
    from moestream.bench.harness import BenchConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark a server (ours or llama-server) on real prompts")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--target", metavar="URL", help="a running OpenAI-compatible server with llama-server timings"
    )
    which.add_argument(
        "-m",
        "--model",
        metavar="PATH",
        help="start `moestream serve PATH` (engine options below) and bench it",
    )
    add_hf_argument(which)
    p.add_argument(
        "--prompts",
        default="builtin",
        help="builtin (12: 6 Korean, 6 English), or a file: one prompt "
        "per line, or a JSON list (default builtin)",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request, greedy (default 256)")
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end a request at end-of-text (default: generate "
        "exactly --max-tokens, llama-server's ignore_eos)",
    )
    p.add_argument(
        "--baseline",
        metavar="FILE",
        help="a previous results.json: compare the texts character for character",
    )
    p.add_argument(
        "--fit-with",
        metavar="FILE",
        action="append",
        default=[],
        help="another run's results.json to fit time/token vs MiB/token over (repeatable)",
    )
    p.add_argument(
        "--memory-limit",
        metavar="SIZE",
        help="drop the page cache and run the server inside a cgroup memory limit (root; with --model only)",
    )
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before starting (root)")
    p.add_argument(
        "--readahead-kb",
        type=int,
        default=None,
        help="set the model disk's read_ahead_kb for the run, restore it afterwards (root)",
    )
    p.add_argument(
        "--disk-of", metavar="PATH", help="count reads of the disk holding PATH (default: --model)"
    )
    p.add_argument("--trace", metavar="FILE", help="record the server's routing to FILE (with --model only)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("MOESTREAM_API_KEY"),
        help="send 'Authorization: Bearer KEY' to the server (default: $MOESTREAM_API_KEY)",
    )
    p.add_argument("--label", default="", help="name of this run in reports and fits")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--out", required=True, metavar="DIR", help="where results.json, report.md and plots go")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options the user changed, as `moestream serve` command-line arguments."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(probe)
    argv: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or value == action.default:
            continue
        if action.nargs == 0:  # store_true / store_const flags
            argv.append(action.option_strings[0])
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


def build_config(args: argparse.Namespace) -> BenchConfig:
    from moestream.bench.harness import BenchConfig
    from moestream.bench.server import free_port, moestream_serve_argv
    from moestream.units import parse_size

    if args.target and args.trace:
        raise MoestreamError("--trace records a server this command starts; use --model PATH")
    changed = [a for a in engine_argv(args) if a.startswith("--")]
    if args.target and changed:
        raise MoestreamError(
            f"engine options ({' '.join(changed)}) apply to --model only, not to a --target server"
        )
    try:
        limit = parse_size(args.memory_limit) if args.memory_limit else None
    except ValueError as exc:
        raise MoestreamError(f"--memory-limit: {exc}") from None
    port = free_port() if args.model else None
    argv = moestream_serve_argv(args.model, port, engine_argv(args), args.trace) if args.model else None
    return BenchConfig(
        out=Path(args.out),
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        target=args.target,
        server_argv=argv,
        port=port,
        disk_of=args.disk_of or args.model,
        memory_limit=limit,
        readahead_kb=args.readahead_kb,
        drop_caches=args.drop_caches,
        ignore_eos=not args.stop_at_eos,
        baseline=args.baseline,
        fit_with=args.fit_with,
        label=args.label,
        plots=not args.no_plots,
        api_key=args.api_key,
        # the key the client sends is the key the server it starts requires (else it checks none)
        server_env={**os.environ, "MOESTREAM_API_KEY": args.api_key} if args.model and args.api_key else None,
        server_name="moestream" if args.model else "server",
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    print("moestream bench: terminated; stopping the server and restoring the machine", file=sys.stderr)
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    from moestream.bench.harness import run_bench
    from moestream.bench.report import summary_lines

    if args.hf_repo:  # downloaded here, so that the server it starts loads it from the cache
        from moestream.store.hub import fetch

        args.model = str(fetch(args.hf_repo))
    if args.model and not Path(args.model).exists():
        raise MoestreamError(f"--model {args.model} does not exist")
    config = build_config(args)
    # a plain kill must still stop the server and remove the cgroup and readahead change (finally blocks)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        results = run_bench(config)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if results["mode_line"]:
        print(results["mode_line"])
    for line in summary_lines(results):
        print(line)
    print(f"moestream: wrote {config.out / 'results.json'} and report.md")
    return 0

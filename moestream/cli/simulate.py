"""`moestream simulate TRACE... --budgets 0.5GiB,1GiB`: replay a router trace through the cache policies."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from moestream.errors import MoestreamError
from moestream.units import format_size, parse_size

DEFAULT_BUDGETS = "0.5GiB,1GiB,2GiB,4GiB"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `simulate` verb."""
    from moestream.trace.simulator import POLICIES

    p = subparsers.add_parser(
        "simulate",
        help="replay a router trace through the cache policies at several budgets",
        description="Replay a router trace (moestream Parquet/JSONL, speculative-moe JSONL, or "
        "vLLM-MoE-Logger JSONL files; several of the latter are merged as layers of one model) through the "
        "engine's eviction policies and report MiB read per token and hit rate.",
    )
    p.add_argument("trace", nargs="+", help="trace file(s); the format is detected from the content")
    p.add_argument(
        "--budgets",
        default=DEFAULT_BUDGETS,
        help=f"comma-separated cache budgets (default {DEFAULT_BUDGETS})",
    )
    p.add_argument(
        "--policy",
        nargs="+",
        metavar="NAME",
        help=f"policies to run (default all of {', '.join(POLICIES)}; "
        "the *-prefetch ones only when the trace has predictions)",
    )
    p.add_argument(
        "--unit-bytes",
        help="bytes of one expert (gate+up+down), for traces that lack it; overrides the header",
    )
    p.add_argument(
        "--prefetch-top", type=int, help="predicted experts per token that *-prefetch read (default top_k)"
    )
    p.add_argument(
        "--prefetch-min-score",
        type=float,
        default=0.0,
        help="*-prefetch read only predicted experts whose stale-gate softmax score is at least this "
        "(the engine's prefetch uses 4 / experts per layer)",
    )
    p.add_argument(
        "-np",
        "--parallel",
        type=int,
        metavar="N",
        help="replay the requests as N running at once (serve --parallel N): each round one decode forward "
        "of every running request, their experts' union read once, then one prompt forward (default: the "
        "steps as recorded; 1: one request at a time)",
    )
    p.add_argument(
        "--gpu-tier",
        metavar="SIZE",
        help="a GPU tier of SIZE in front of each budget's host cache, as the engine's --gpu-tier with "
        "misses copied in (exclusive tiers where the host cache streams); lru and lfu only",
    )
    p.add_argument("--plot", metavar="PNG", help="write MiB/token against budget to this PNG")
    p.add_argument("--json", action="store_true", help="print the records as a JSON list instead of a table")
    p.set_defaults(func=run)


def parse_budgets(text: str) -> list[int]:
    """ "0.5GiB,1GiB" -> bytes, sorted; a user error names the bad entry."""
    budgets = []
    for item in (x for x in text.split(",") if x.strip()):
        try:
            budgets.append(parse_size(item.strip()))
        except ValueError as exc:
            raise MoestreamError(f"bad budget {item.strip()!r} in --budgets: {exc}") from None
    if not budgets:
        raise MoestreamError("--budgets names no budget")
    return sorted(set(budgets))


def choose_policies(names: list[str] | None, has_predictions: bool) -> tuple[list[str], list[str]]:
    """Canonical policy names (aliases resolved) and notes about what was left out."""
    from moestream.trace.simulator import ALIASES, POLICIES, PREFETCHING

    if not names:
        chosen = [p for p in POLICIES if p not in PREFETCHING or has_predictions]
        skipped = ", ".join(PREFETCHING)
        notes = [] if has_predictions else [f"{skipped} skipped: the trace has no stale-gate predictions"]
        return chosen, notes
    chosen = []
    for name in names:
        canon = ALIASES.get(name.lower(), name.lower())
        if canon not in POLICIES:
            raise MoestreamError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
        if canon not in chosen:
            chosen.append(canon)
    return chosen, []


def run(args: argparse.Namespace) -> int:
    """Load, replay, print (table or JSON), optionally plot."""
    from moestream.trace.reader import load_traces
    from moestream.trace.report import simulate_table
    from moestream.trace.simulator import simulate

    budgets = parse_budgets(args.budgets)
    try:
        unit = parse_size(args.unit_bytes) if args.unit_bytes else None
    except ValueError as exc:
        raise MoestreamError(f"bad --unit-bytes {args.unit_bytes!r}: {exc}") from None
    if unit is not None and unit < 1:
        raise MoestreamError(f"--unit-bytes must be a positive size, got {args.unit_bytes!r}")
    if args.prefetch_top is not None and args.prefetch_top < 1:
        raise MoestreamError(f"--prefetch-top must be at least 1, got {args.prefetch_top}")
    if args.plot:
        from moestream.trace.atomic import check_output_path

        check_output_path(args.plot, "plot")
        if Path(args.plot).suffix.lower() not in (".png", ".svg", ".pdf"):
            raise MoestreamError(f"--plot {args.plot} must end in .png, .svg or .pdf")
    gpu_tier = None
    if args.gpu_tier:
        try:
            gpu_tier = parse_size(args.gpu_tier)
        except ValueError as exc:
            raise MoestreamError(f"bad --gpu-tier {args.gpu_tier!r}: {exc}") from None
    if args.parallel is not None and args.parallel < 1:
        raise MoestreamError(f"--parallel must be at least 1, got {args.parallel}")
    trace = load_traces(args.trace)
    if args.parallel is not None:
        from moestream.trace.batched import batch_steps

        trace = batch_steps(trace, args.parallel)
        trace.notes.append(
            f"forwards regrouped as {args.parallel} request{'s' if args.parallel > 1 else ''} at once "
            f"(--parallel {args.parallel}), requests started in order of first appearance, a round's "
            "forwards side by side, layer by layer (one after the other for a prefetching policy or a "
            "GPU tier)"
        )
    width = trace.pred_experts.shape[1] if trace.pred_experts is not None else 0
    if args.prefetch_top is not None and width and args.prefetch_top > width:
        raise MoestreamError(
            f"--prefetch-top {args.prefetch_top} exceeds the {width} predicted experts per "
            "token the trace holds"
        )
    if gpu_tier is not None and not args.policy:
        args.policy = ["lru", "lfu"]  # the policies a replay with a GPU tier runs
    policies, notes = choose_policies(args.policy, trace.has_predictions)
    trace.notes.extend(notes)
    _warn_prefetch_options(args, policies)
    if args.prefetch_top is not None and args.prefetch_top < 1:
        raise MoestreamError(f"--prefetch-top must be at least 1, got {args.prefetch_top}")
    records, replay, sizes = simulate(
        trace, policies, budgets, unit, args.prefetch_top, args.prefetch_min_score, gpu_tier
    )
    if args.json:
        from moestream.trace.report import SYNTHETIC_NOTE

        synthetic = [SYNTHETIC_NOTE] if trace.header.synthetic else []
        for note in [*synthetic, *trace.all_notes, *sizes.notes]:
            print(f"note: {note}", file=sys.stderr)
        print(json.dumps(records, indent=1))
    else:
        print(simulate_table(records, trace, replay, sizes, budgets, policies))
    if args.plot:
        from moestream.trace.plot import plot_curves

        name = Path(args.trace[0]).name + (f" (+{len(args.trace) - 1} more)" if len(args.trace) > 1 else "")
        title = (
            f"{name}; {trace.header.model_id}; expert {format_size(sizes.unit[replay.layers[0]])}, "
            f"slot {format_size(sizes.slot_bytes)}"
        )
        plot_curves(records, args.plot, title, trace.header.synthetic)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _warn_prefetch_options(args: argparse.Namespace, policies: list[str]) -> None:
    """--prefetch-top and --prefetch-min-score shape the *-prefetch policies only."""
    from moestream.trace.simulator import PREFETCHING

    given = [
        flag
        for flag, value, default in (
            ("--prefetch-top", args.prefetch_top, None),
            ("--prefetch-min-score", args.prefetch_min_score, 0.0),
        )
        if value != default
    ]
    if given and not any(p in PREFETCHING for p in policies):
        warnings.warn(
            f"{' and '.join(given)} shape{'' if len(given) > 1 else 's'} the "
            f"{' and '.join(PREFETCHING)} policies only, and none of them runs here",
            stacklevel=2,
        )

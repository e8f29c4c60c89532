"""`moestream predict-eval TRACE...`: recall of the stale-gate expert prediction (and a previous-token
baseline)."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `predict-eval` verb."""
    p = subparsers.add_parser(
        "predict-eval",
        help="how well next-layer experts are predicted (stale gate, previous token)",
        description="Recall of the stale-gate prediction recorded in a trace (layer L+1's router on "
        "layer L's input) at top-k, top-1.5k, top-2k and two layers ahead, and of the previous token's "
        "experts. "
        "On synthetic checkpoints the figures are an upper bound and are labelled so.",
    )
    p.add_argument("trace", nargs="+", help="trace file(s); the format is detected from the content")
    p.add_argument("--json", action="store_true", help="print the records as a JSON list")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load, evaluate, print."""
    from moestream.trace.predict import evaluate
    from moestream.trace.reader import load_traces
    from moestream.trace.report import SYNTHETIC_NOTE, predict_table

    trace = load_traces(args.trace)
    records = evaluate(trace)
    if args.json:
        for note in trace.all_notes + ([SYNTHETIC_NOTE] if trace.header.synthetic else []):
            print(f"note: {note}", file=sys.stderr)
        print(json.dumps(records, indent=1))
    else:
        print(predict_table(records, trace))
    return 0

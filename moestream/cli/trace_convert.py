"""`moestream trace-convert IN... OUT`: any supported trace (or several vLLM-logger files) to Parquet or
JSONL."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moestream.errors import MoestreamError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `trace-convert` verb."""
    p = subparsers.add_parser(
        "trace-convert",
        help="convert a trace to moestream Parquet (.parquet) or JSONL (.jsonl)",
        description="Read any supported trace (format detected from the content; a killed writer's .partial "
        "stream too) and write it as moestream Parquet or JSONL, chosen by OUT's extension.",
    )
    p.add_argument("inputs", nargs="+", metavar="IN", help="trace file(s)")
    p.add_argument("out", metavar="OUT", help="output file: .parquet or .jsonl")
    p.add_argument("--unit-bytes", help="record this expert size (bytes, e.g. 17301504) in the header")
    p.add_argument("--dtype", help="record this expert dtype (e.g. bf16) in the header")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Read, optionally fill in sizes, write."""
    import pyarrow.parquet as pq

    from moestream.trace.atomic import atomic_output, check_output_path
    from moestream.trace.jsonl import write_jsonl
    from moestream.trace.reader import load_traces
    from moestream.trace.replay import check_ids
    from moestream.units import parse_size

    out = Path(args.out)
    if out.suffix not in (".parquet", ".jsonl"):
        raise MoestreamError(f"output {out} must end in .parquet or .jsonl")
    check_output_path(out)
    trace = load_traces(args.inputs)
    if not len(trace):  # an empty OUT would only fail later, in simulate or predict-eval: refuse it here
        names = ", ".join(str(path) for path in args.inputs)
        raise MoestreamError(f"the trace {names} holds no rows; nothing was written to {out}")
    check_ids(trace)  # a converted file with ids outside its header would only fail later, elsewhere
    if args.unit_bytes:
        try:
            unit = parse_size(args.unit_bytes)
        except ValueError as exc:
            raise MoestreamError(f"bad --unit-bytes {args.unit_bytes!r}: {exc}") from None
        if unit < 1:
            raise MoestreamError(f"--unit-bytes must be a positive size, got {args.unit_bytes!r}")
        trace.header.expert_bytes = [unit] * trace.header.n_layers
    if args.dtype:
        trace.header.dtype = args.dtype
    trace.header.notes = trace.all_notes  # keep the reader's notes (a recovered stream, say) with the rows
    if out.suffix == ".jsonl":
        write_jsonl(trace, out)
    else:
        with atomic_output(out) as tmp:
            pq.write_table(trace.to_table(), tmp, compression="zstd")
    print(f"wrote {len(trace)} rows to {out}", file=sys.stderr)
    return 0

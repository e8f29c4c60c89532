"""`moestream plan PATH`: the decode speed and MiB read per token to expect at a range of cache budgets,
from a routing trace, the disk's read rate and the compute cost per token (`moestream.bench.plan`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from moestream.cli._engine_args import add_dtype_argument, add_model_argument, model_path
from moestream.errors import MoestreamError
from moestream.units import parse_size

DEFAULT_READ_SECONDS = 2.5
SYNTHETIC_ROUTING = (
    "SYNTHETIC ROUTING: the trace was recorded on a random-weight checkpoint, so its hit rates are that "
    "checkpoint's, not a trained model's (record a trace on a trained model and pass it with --trace)"
)
RATE_TOKENS = 16  # tokens decoded at the smallest budget to measure the engine's read rate
POLICIES = ("lru", "lfu", "predictive")  # the ones a live engine runs (`--policy` of generate)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the `plan` verb."""
    p = sub.add_parser(
        "plan",
        help="predict decode tok/s and MiB read per token at several cache budgets",
        description="Predict decode speed and MiB read per token at a range of expert-cache budgets: a "
        "routing trace (recorded here on --prompt/--prompts, or --trace FILE) replayed through the engine's "
        "eviction policy at each budget, the compute cost of a token measured with every needed expert "
        "cached, and the engine's O_DIRECT read rate measured on a few tokens at the smallest budget (the "
        "disk alone, through the engine's reader, is measured for a few seconds beside it). "
        "predicted ms/token = compute at the budget + MiB/token / read rate.",
    )
    add_model_argument(p)
    source = p.add_argument_group("routing")
    source.add_argument(
        "--trace",
        metavar="FILE",
        help="a router trace recorded on this model (`--trace` of generate/serve, or any format `moestream "
        "simulate` reads); default: record one here on the prompts",
    )
    source.add_argument(
        "-p",
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt to record the routing on and to measure compute with (repeatable; default: two "
        "built-in prompts)",
    )
    source.add_argument(
        "--prompts", metavar="FILE", help="prompts, one per line (with or instead of --prompt)"
    )
    source.add_argument(
        "-n",
        "--max-tokens",
        type=int,
        default=32,
        metavar="N",
        help="tokens generated per prompt, in each of the two passes (default 32)",
    )
    source.add_argument("--save-trace", metavar="FILE", help="keep the trace recorded here (Parquet)")
    p.add_argument(
        "--budgets",
        help="comma-separated cache budgets (default: powers of two from the model's minimum, and the "
        "budget that holds every expert)",
    )
    p.add_argument(
        "--policy",
        default="lru",
        choices=POLICIES,
        help="eviction policy to replay (default lru, the engine's)",
    )
    p.add_argument(
        "--plot", metavar="PNG", help="write predicted tok/s and MiB/token against budget to this PNG"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    disk = p.add_argument_group("disk and compute")
    disk.add_argument(
        "--read-rate",
        metavar="SIZE",
        help="the read rate per second to predict with (e.g. 1.1GiB), instead of measuring the engine's at "
        "the smallest budget (compute is then the cached one at every budget)",
    )
    disk.add_argument(
        "--read-seconds",
        type=float,
        default=None,
        help=f"how long the disk alone is measured (random whole experts, shown beside the engine's own "
        f"rate; default {DEFAULT_READ_SECONDS:g} s)",
    )
    disk.add_argument("--io-threads", type=int, default=4, help="I/O threads (default 4, the engine's)")
    disk.add_argument("--piece", default="128KiB", help="size of one read (default 128KiB, the engine's)")
    disk.add_argument(
        "-t", "--threads", type=int, default=None, help="compute threads (default: the physical cores)"
    )
    add_dtype_argument(disk)
    disk.add_argument(
        "--trunk",
        default="auto",
        choices=["auto", "ggml", "eager"],
        help="how the non-expert part runs, as for generate (default auto)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check the inputs, measure, replay, print the table (or JSON), plot."""
    options = _check_args(args)
    path = model_path(args)  # after the checks: a model by name (-hf) may be downloaded here
    from moestream.bench.plan import (
        ALL_EXPERTS,
        AUTO,
        check_budgets,
        default_budgets,
        fit_trace,
        model_sizes,
        plan_rows,
    )

    emap, top_k, n_layers = _experts_of(path)
    sizes = model_sizes(emap, top_k, n_layers)
    budgets = _budgets(args, sizes, default_budgets)
    check_budgets(list(budgets), sizes)
    budgets[sizes.all_experts] = ALL_EXPERTS  # the compute-bound end of the range, always shown
    given = _given_trace(args)
    if given is not None:
        fit_trace(given, emap, top_k, sizes, args.trace)  # a trace of another model fails before measuring
    prompts = _prompts(args)
    ceiling = None if args.read_rate else _ceiling(args, emap, top_k)  # first: before any engine runs
    with tempfile.TemporaryDirectory(prefix="moestream-plan-") as tmp:
        record = None if given is not None else Path(args.save_trace or Path(tmp) / "plan-trace.parquet")
        compute, engine_rate, auto = _measure(path, prompts, args, record, sizes, options)
        trace = given if record is None else _read(record)
    rate = _given_rate(args) if args.read_rate else engine_rate.bytes_per_s
    trace = fit_trace(trace, emap, top_k, sizes, args.trace or "recorded here")
    budgets[auto[0]] = AUTO if auto[0] != sizes.all_experts else f"{AUTO} = {ALL_EXPERTS}"
    streaming = compute.ms_per_token if engine_rate is None else engine_rate.streaming_ms
    rows, notes = plan_rows(trace, budgets, args.policy, (compute.ms_per_token, streaming), rate)
    notes = [f"auto budget, as sized for this process: {auto[1]}", *notes]
    _report(args, path, trace, rows, notes, compute, (rate, engine_rate, ceiling), prompts, given is None)
    return 0


def _check_args(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a user can get wrong, checked before anything is loaded; the engine options."""
    from moestream.trace.atomic import check_output_path

    if args.max_tokens < 2:
        raise MoestreamError(
            f"--max-tokens must be at least 2 (a decoded token to time), got {args.max_tokens}"
        )
    if args.read_seconds is not None and args.read_rate:
        raise MoestreamError(
            "--read-seconds sets how long the read rate is measured; with --read-rate it is not"
        )
    if args.read_seconds is None:
        args.read_seconds = DEFAULT_READ_SECONDS
    if args.read_seconds <= 0:
        raise MoestreamError(f"--read-seconds must be positive, got {args.read_seconds}")
    if args.trace and args.save_trace:
        raise MoestreamError("--save-trace keeps a trace recorded here; with --trace FILE none is recorded")
    for name in ("plot", "save_trace"):
        value = getattr(args, name)
        if value:
            check_output_path(value, "plot" if name == "plot" else "trace")
    if args.plot and Path(args.plot).suffix.lower() != ".png":
        raise MoestreamError(f"--plot {args.plot} must end in .png")
    try:
        piece = parse_size(args.piece)
    except ValueError as exc:
        raise MoestreamError(f"bad --piece {args.piece!r}: {exc}") from None
    if piece < 4096 or piece % 4096:
        raise MoestreamError(f"--piece must be a positive multiple of 4 KiB, got {args.piece}")
    if not 1 <= args.io_threads <= 256:
        raise MoestreamError(f"--io-threads must be between 1 and 256, got {args.io_threads}")
    return dict(
        io_threads=args.io_threads, piece=piece, threads=args.threads, dtype=args.dtype, trunk=args.trunk
    )


def _experts_of(path: str) -> tuple[Any, int, int]:
    """The checkpoint's expert map, top-k and decoder layers, read from its headers (no weights)."""
    from moestream.model.arch import arch_for, num_experts, text_config, top_k
    from moestream.store.source import open_source

    source = open_source(path)
    config = source.config()
    emap = source.expert_map(arch_for(config).family, num_experts(config))
    return emap, top_k(config), int(text_config(config).num_hidden_layers)


def _budgets(args: argparse.Namespace, sizes: Any, default: Any) -> dict[int, str]:
    """Budget bytes -> label ("" for a plain budget)."""
    if not args.budgets:
        return dict.fromkeys(default(sizes), "")
    from moestream.cli.simulate import parse_budgets

    return dict.fromkeys(parse_budgets(args.budgets), "")


def _given_trace(args: argparse.Namespace) -> Any:
    return _read(Path(args.trace)) if args.trace else None


def _read(path: Path) -> Any:
    from moestream.trace.reader import load_traces

    return load_traces([path])


def _prompts(args: argparse.Namespace) -> list[str]:
    from moestream.bench.plan_measure import DEFAULT_PROMPTS

    prompts = list(args.prompt or [])
    if args.prompts:
        try:
            text = Path(args.prompts).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise MoestreamError(f"cannot read the prompts file {args.prompts}: {exc}") from None
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            raise MoestreamError(f"the prompts file {args.prompts} holds no prompt")
        prompts += lines
    if any(not p.strip() for p in prompts):
        raise MoestreamError("a --prompt is empty")
    return prompts or list(DEFAULT_PROMPTS)


def _measure(
    path: str,
    prompts: list[str],
    args: argparse.Namespace,
    record: Path | None,
    sizes: Any,
    options: dict[str, Any],
) -> tuple[Any, Any, tuple[int, str]]:
    """The compute cost per token (recording the trace to `record` on the way), the engine's read rate
    at the smallest budget (None with --read-rate), and the auto budget (bytes, how it was chosen)."""
    from moestream.bench.plan_measure import (
        auto_choice,
        load_for_measuring,
        measure_compute,
        measure_engine_rate,
    )

    rate = None
    if not args.read_rate:
        tokens = min(args.max_tokens, RATE_TOKENS)
        print(
            f"moestream plan: decoding {tokens} tokens at the smallest budget (the engine's read rate)",
            file=sys.stderr,
            flush=True,
        )
        rate = measure_engine_rate(path, prompts[0], tokens, sizes.minimum, **options)
    print(
        f"moestream plan: generating {args.max_tokens} tokens on {len(prompts)} prompt(s) twice "
        f"({'recording the routing, then ' if record else ''}timing compute with the experts cached)",
        file=sys.stderr,
        flush=True,
    )
    with load_for_measuring(path, **options) as engine:
        print(engine.mode_line(), file=sys.stderr, flush=True)
        auto = auto_choice(engine)
        compute = measure_compute(engine, prompts, args.max_tokens, record)
    return compute, rate, auto


def _given_rate(args: argparse.Namespace) -> float:
    try:
        rate = parse_size(args.read_rate.removesuffix("/s"))
    except ValueError as exc:
        raise MoestreamError(f"bad --read-rate {args.read_rate!r}: {exc}") from None
    if rate < 1:
        raise MoestreamError(f"--read-rate must be positive, got {args.read_rate}")
    return float(rate)


def _ceiling(args: argparse.Namespace, emap: Any, top_k: int) -> Any:
    """The disk alone: random whole experts through the engine's reader, top-k in flight."""
    from moestream.bench.ceiling import measure_read_rate

    print(f"moestream plan: measuring the disk's read rate for {args.read_seconds:g} s", file=sys.stderr)
    return measure_read_rate(
        emap, args.read_seconds, "direct", args.io_threads, parse_size(args.piece), depth=top_k
    )


def _report(
    args: argparse.Namespace,
    path: str,
    trace: Any,
    rows: list[Any],
    notes: list[str],
    compute: Any,
    rates: tuple[float, Any, Any],
    prompts: list[str],
    recorded: bool,
) -> None:
    """The inputs and notes, then the table (stdout) or JSON (stdout, the lines on stderr); the plot."""
    rate, engine_rate, ceiling = rates
    decode = int((trace.phase == 1).sum() // max(1, len(set(trace.layer.tolist()))))
    lines = _lines(args, path, trace, notes, compute, rates, prompts, recorded, decode)
    if args.json:
        for line in lines:
            print(line, file=sys.stderr)
        out = {
            "model": path,
            "policy": args.policy,
            "synthetic_routing": trace.header.synthetic,
            "decode_tokens": decode,
            "read_bytes_per_s": rate,
            "read_rate_measured": engine_rate is not None,
            "engine_read": None if engine_rate is None else dataclasses.asdict(engine_rate),
            "ceiling_bytes_per_s": None if ceiling is None else ceiling.bytes_per_s,
            "compute_ms_per_token": compute.ms_per_token,
            "streaming_compute_ms_per_token": None if engine_rate is None else engine_rate.streaming_ms,
            "compute_tokens": compute.tokens,
            "auto": next((r.budget_bytes for r in rows if r.label.startswith("auto")), None),
            "rows": [r.to_dict() for r in rows],
        }
        print(json.dumps(out, indent=1))
    else:
        from moestream.bench.plan_report import print_table

        print_table(rows, "predicted decode speed by expert cache budget", lines)
    if args.plot:
        from moestream.bench.plan_report import plot_plan

        title = (
            f"{Path(path).name}: compute {compute.ms_per_token:.1f} ms/token, read rate "
            f"{rate / (1 << 30):.2f} GiB/s" + (" (synthetic routing)" if trace.header.synthetic else "")
        )
        plot_plan(rows, args.plot, title)
        print(f"wrote {args.plot}", file=sys.stderr)


def _lines(
    args: argparse.Namespace,
    path: str,
    trace: Any,
    notes: list[str],
    compute: Any,
    rates: tuple[float, Any, Any],
    prompts: list[str],
    recorded: bool,
    decode: int,
) -> list[str]:
    """What the table was computed from, one line each, and the notes."""
    rate, engine_rate, ceiling = rates
    where = (
        f"recorded here on {len(prompts)} prompt(s), {args.max_tokens} tokens each"
        + (f" (kept in {args.save_trace})" if args.save_trace else "")
        if recorded
        else f"{args.trace} ({trace.header.source or trace.header.model_id})"
    )
    read = f"{rate / (1 << 30):.3f} GiB/s (given)" if engine_rate is None else engine_rate.line()
    return [
        f"model: {path}",
        f"routing: {where}; {decode} decode tokens; policy {args.policy}",
        f"compute: {compute.line()}",
        f"read rate: {read}",
        *([f"the disk alone (O_DIRECT, random whole experts): {ceiling.line()}"] if ceiling else []),
        "predicted ms/token = compute + MiB/token / read rate; compute = cached + (streaming - cached) x "
        "miss rate (a missed expert is computed on its own as it lands); 'if overlapped' = max(compute, "
        "read), a bound",
        *([SYNTHETIC_ROUTING] if trace.header.synthetic else []),
        *(f"note: {n}" for n in [*trace.all_notes, *notes]),
    ]

"""`moestream plan` against real runs: predicted and measured decode tok/s at three cache budgets.

Each round runs `moestream plan CHECKPOINT --json` (its own trace, read rate and compute cost), then one
real run per budget, each started after the page cache is dropped (root), the budgets' order rotated
from round to round, so that the plan and the runs it predicts are measured close together on a shared,
noisy machine. Two routings:

- the checkpoint's own (default): plan records the routing of `--prompt` (`--max-tokens` tokens), and
  each real run is `moestream generate CHECKPOINT --prompt ... --ignore-eos --cache BUDGET --json`, the
  same greedy tokens, so the simulator's MiB/token must equal the measured one;
- a given trace (`--trace FILE`, e.g. the trained fixture's learned routing recorded with `moestream
  generate ../shared/fixtures/stdlib-moe-8x64 --trace FILE`, on a synthetic checkpoint of the same
  layers, experts and top-k at real expert size): `plan --trace FILE`, and each real run is
  `moestream generate CHECKPOINT --replay-routing FILE --cache BUDGET --json`.

    python benchmarks/plan_check.py CHECKPOINT --budgets 512MiB,2GiB,4GiB [--trace FILE] [--rounds 2]

Prints one line per (round, budget) and a summary: measured / predicted tok/s for the serial model
(compute + read, what plan reports) and the overlapped one (max of the two), target within 20%. The
disk's rate drifts by tens of percent within a minute on a shared machine, so each real run is also
bracketed by two read-rate samples (plan's own measurement, 1.5 s each, before and after it) and plan's
formula is evaluated again with their mean ("adjacent rate"): that separates the model's error from the
disk's drift between plan and the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MOESTREAM = [sys.executable, "-m", "moestream"]
DEFAULT_PROMPT = "Explain, step by step, why the sky is blue during the day and red at sunset."


def drop_page_cache() -> bool:
    """sync; echo 3 > drop_caches (needs root). Returns whether it worked."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_json(cmd: list[str]) -> dict:
    """Run a moestream command; its stdout's last line that is a JSON object (or the whole of it)."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    try:
        return json.loads(out.stdout)
    except json.JSONDecodeError:
        line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith("{"))
        return json.loads(line)


def plan(args: argparse.Namespace, trace_out: Path) -> dict:
    cmd = [*MOESTREAM, "plan", args.checkpoint, "--budgets", args.budgets, "--json", *threads(args)]
    if args.trace:
        cmd += ["--trace", args.trace]
    else:
        cmd += ["--prompt", args.prompt, "--max-tokens", str(args.max_tokens), "--save-trace", str(trace_out)]
    return run_json(cmd)


def threads(args: argparse.Namespace) -> list[str]:
    return [] if args.threads is None else ["--threads", str(args.threads)]


def real_run(args: argparse.Namespace, budget: str) -> dict:
    """A real run's decode figures: tok/s, MiB/token, tokens."""
    cmd = [*MOESTREAM, "generate", args.checkpoint, "--cache", budget, "--json", *threads(args)]
    if args.trace:
        cmd += ["--replay-routing", args.trace]
    else:
        cmd += ["--prompt", args.prompt, "--max-tokens", str(args.max_tokens), "--ignore-eos"]
    stats = run_json(cmd)["stats"]
    decode = stats["decode"]
    return {
        "tok_s": stats["decode_tok_s"],
        "mib_per_token": decode["bytes_read"] / (1 << 20) / max(1, decode["tokens"]),
        "tokens": decode["tokens"],
        "read_gib_s": decode["bytes_read"] / (1 << 30) / decode["seconds"] if decode["seconds"] else 0.0,
    }


def read_rate(checkpoint: str, seconds: float = 1.5) -> float:
    """Bytes/s of random whole experts through the engine's reader, as plan measures it."""
    from moestream.bench.ceiling import measure_read_rate
    from moestream.model.arch import arch_for, num_experts, top_k
    from moestream.store.source import open_source

    source = open_source(checkpoint)
    config = source.config()
    emap = source.expert_map(arch_for(config).family, num_experts(config))
    return measure_read_rate(emap, seconds, depth=top_k(config)).bytes_per_s


def serial_and_overlap(row: dict, compute_ms: float, rate: float) -> tuple[float, float]:
    """plan's two predictions (tok/s) for `row`'s MiB/token and compute with another read rate."""
    read_ms = row["mib_per_token"] * (1 << 20) / rate * 1000
    return 1000 / (compute_ms + read_ms), 1000 / max(compute_ms, read_ms)


def parse_size(text: str) -> int:
    from moestream.units import parse_size as parse

    return parse(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--budgets", default="512MiB,2GiB,4GiB", help="three cache budgets")
    parser.add_argument(
        "--trace", help="replay this trace's routing (plan --trace, generate --replay-routing)"
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads", "-t", type=int, help="compute threads of plan and the runs (default theirs)"
    )
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()
    budgets = [b.strip() for b in args.budgets.split(",")]
    results = []
    print(
        f"date {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; routing: {args.trace or 'the checkpoint own'}; "
        f"threads {args.threads or 'default'}"
    )
    print(HEAD)
    with tempfile.TemporaryDirectory(prefix="plan-check-") as tmp:
        for round_ in range(args.rounds):
            predicted = plan(args, Path(tmp) / f"trace{round_}.parquet")
            order = budgets[round_ % len(budgets) :] + budgets[: round_ % len(budgets)]
            for budget in order:
                results.append(check(args, round_, budget, predicted))
                print(line(results[-1]), flush=True)
    summarize(results, budgets)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


HEAD = (
    f"{'round':>5} {'budget':>8} {'MiB/tok pred':>12} {'meas':>7} {'compute ms':>10} "
    f"{'GiB/s plan':>10} {'adjacent':>8} {'decoding':>8} {'tok/s pred':>10} {'overlap':>7} "
    f"{'pred@adj':>8} {'ovl@adj':>7} {'meas':>6} {'meas/pred':>9} {'/overlap':>8} {'/pred@adj':>9} "
    f"{'/ovl@adj':>8}"
)


def check(args: argparse.Namespace, round_: int, budget: str, predicted: dict) -> dict:
    """One real run at `budget`, bracketed by read-rate samples, against plan's row for it. The page
    cache is dropped after the first sample: right after a drop the other processes on the machine read
    their files back, and a sample then measures that contention, not the disk the run will see."""
    before = read_rate(args.checkpoint)
    dropped = drop_page_cache()
    real = real_run(args, budget)
    adjacent = (before + read_rate(args.checkpoint)) / 2
    row = next(r for r in predicted["rows"] if r["budget_bytes"] == parse_size(budget))
    adj_serial, adj_overlap = serial_and_overlap(row, row["compute_ms"], adjacent)
    return {
        "round": round_,
        "budget": budget,
        "predicted": row,
        "read_bytes_per_s": predicted["read_bytes_per_s"],
        "compute_ms_per_token": predicted["compute_ms_per_token"],
        "synthetic_routing": predicted["synthetic_routing"],
        "measured": real,
        "page_cache_dropped": dropped,
        "ratio": real["tok_s"] / row["tok_s"],
        "ratio_overlap": real["tok_s"] / row["overlap_tok_s"],
        "adjacent_read_bytes_per_s": adjacent,
        "adjacent_tok_s": adj_serial,
        "adjacent_overlap_tok_s": adj_overlap,
        "ratio_adjacent": real["tok_s"] / adj_serial,
        "ratio_adjacent_overlap": real["tok_s"] / adj_overlap,
    }


def line(r: dict) -> str:
    row, real = r["predicted"], r["measured"]
    return (
        f"{r['round']:>5} {r['budget']:>8} {row['mib_per_token']:>12.1f} {real['mib_per_token']:>7.1f} "
        f"{row['compute_ms']:>10.1f} {r['read_bytes_per_s'] / (1 << 30):>10.3f} "
        f"{r['adjacent_read_bytes_per_s'] / (1 << 30):>8.3f} {real['read_gib_s']:>8.3f} "
        f"{row['tok_s']:>10.2f} {row['overlap_tok_s']:>7.2f} {r['adjacent_tok_s']:>8.2f} "
        f"{r['adjacent_overlap_tok_s']:>7.2f} {real['tok_s']:>6.2f} {r['ratio']:>9.2f} "
        f"{r['ratio_overlap']:>8.2f} {r['ratio_adjacent']:>9.2f} {r['ratio_adjacent_overlap']:>8.2f}"
    )


RATIOS = {
    "serial (plan's figure)": "ratio",
    "overlapped": "ratio_overlap",
    "serial, adjacent rate": "ratio_adjacent",
    "overlapped, adjacent rate": "ratio_adjacent_overlap",
}


def summarize(results: list[dict], budgets: list[str]) -> None:
    """Mean measured/predicted per budget and model; the worst mean and the worst single run."""
    print()
    print(f"{'model':<27}" + "".join(f"{b:>9}" for b in budgets) + f"{'worst mean':>12}{'worst run':>11}")
    for name, key in RATIOS.items():
        means = []
        for budget in budgets:
            mine = [r[key] for r in results if r["budget"] == budget]
            means.append(sum(mine) / len(mine))
        worst_mean = max(abs(m - 1) for m in means)
        worst_run = max(abs(r[key] - 1) for r in results)
        verdict = "within 20%" if worst_mean <= 0.2 else "NOT within 20%"
        print(
            f"{name:<27}" + "".join(f"{m:>9.2f}" for m in means) + f"{worst_mean:>11.0%} {worst_run:>10.0%}"
            f"  means {verdict}"
        )
    if not all(r["page_cache_dropped"] for r in results):
        print("the page cache could not be dropped (not root): runs may have read from it")


if __name__ == "__main__":
    main()

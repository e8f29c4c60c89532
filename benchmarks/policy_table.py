"""Decode MiB/token of the eviction policies at 12.5 / 25 / 50% of a trace's experts, as Markdown tables.

The budget is a share of the slots every expert of the trace's layers would take (layers present x
experts x slot bytes), rounded down to whole slots, so each column is the same share on every trace.
Each trace is replayed by `moestream.trace.simulator.simulate` (the engine's own policy classes).

    .venv/bin/python benchmarks/policy_table.py NAME=TRACE[+TRACE...][@UNIT_BYTES]... [--shares 0.125,0.25]

e.g. fixture=/tmp/fixture.parquet mixtral=../shared/traces/mixtral-8x7b-humaneval-routing.jsonl@352321536
"""

from __future__ import annotations

import argparse
import time

from moestream.trace.reader import load_traces
from moestream.trace.replay import build_replay
from moestream.trace.simulator import resolve_sizes, simulate

POLICIES = ["lru", "lfu", "predictive", "opt"]


def mib(value: float) -> str:
    """MiB/token with three significant figures, thousands separated."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def table(name: str, paths: list[str], unit: int | None, shares: list[float]) -> str:
    """One Markdown table for one trace: a row per policy, a column per share, plus the ratios."""
    trace = load_traces(paths)
    replay = build_replay(trace)
    sizes = resolve_sizes(trace.header, replay.layers, unit)
    all_slots = len(replay.layers) * trace.header.n_experts
    budgets = [int(all_slots * s) * sizes.slot_bytes for s in shares]
    start = time.perf_counter()
    records, replay, _ = simulate(trace, POLICIES, budgets, unit)
    took = time.perf_counter() - start
    cell = {
        (r["policy"], r["budget_bytes"]): r for r in records if r["phase"] == "decode" and r["scope"] == "all"
    }
    routing = "synthetic (random-weight checkpoint)" if trace.header.synthetic else "learned"
    out = [
        f"**{name}** ({routing} routing; {len(replay.layers)} layers x {trace.header.n_experts} experts, "
        f"top-{trace.header.top_k}; {replay.tokens[1] + replay.tokens[3]} decode tokens; "
        f"replayed in {took:.1f} s)",
        "",
        "| policy | " + " | ".join(f"{s:.1%} ({int(all_slots * s)} slots)" for s in shares) + " |",
        "|---|" + "---|" * len(shares),
    ]
    for policy in POLICIES:
        label = "opt (Belady, bound)" if policy == "opt" else policy
        out.append(
            f"| {label} | "
            + " | ".join(
                f"{mib(cell[(policy, b)]['mib_per_token'])} ({cell[(policy, b)]['hit_rate']:.1%})"
                for b in budgets
            )
            + " |"
        )
    ratio = []
    for b in budgets:
        best = min(cell[("lru", b)]["bytes_read"], cell[("lfu", b)]["bytes_read"])
        new, opt = cell[("predictive", b)]["bytes_read"], cell[("opt", b)]["bytes_read"]
        ratio.append(f"{new / best - 1:+.2%} / {new / opt:.2f}x" if best and opt else "-")
    out.append("| predictive vs better of lru, lfu / vs opt | " + " | ".join(ratio) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", metavar="NAME=TRACE[+TRACE...][@UNIT_BYTES]")
    parser.add_argument("--shares", default="0.125,0.25,0.5")
    args = parser.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    for spec in args.traces:
        name, _, rest = spec.partition("=")
        files, _, unit = rest.partition("@")
        print(table(name, files.split("+"), int(unit) if unit else None, shares), end="\n\n", flush=True)


if __name__ == "__main__":
    main()

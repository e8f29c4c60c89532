"""Plain-text tables for `moestream simulate` and `moestream predict-eval` (pipe-friendly, no colour)."""

from __future__ import annotations

from typing import Any

from moestream.trace.replay import Replay
from moestream.trace.simulator import PREFETCHING, Sizes
from moestream.trace.table import Trace
from moestream.units import format_size

SYNTHETIC_NOTE = (
    "UPPER BOUND: this trace was recorded on a synthetic (random-weight) checkpoint, where the "
    "residual stream barely changes between layers; its predictions and prefetch gains are far "
    "easier than on a real model"
)


def describe(trace: Trace) -> list[str]:
    """Header lines shared by both verbs: source, model shape, what was assumed."""
    h = trace.header
    lines = [
        f"trace: {h.source or h.model_id}",
        f"model: {h.model_id}; {h.n_layers} layers, {h.n_experts} experts, top-{h.top_k}; dtype {h.dtype}; "
        f"{len(trace)} rows",
    ]
    if h.synthetic:
        lines.append(SYNTHETIC_NOTE)
    notes = trace.all_notes
    if notes:
        lines.append("assumed:")
        lines += [f"  - {note}" for note in notes]
    return lines


def simulate_table(
    records: list[dict[str, Any]],
    trace: Trace,
    replay: Replay,
    sizes: Sizes,
    budgets: list[int],
    policies: list[str],
) -> str:
    """The simulate report: MiB read per token (hit rate) per policy and budget, decode then prefill."""
    slot = format_size(sizes.slot_bytes)
    units = sorted({sizes.unit[lay] for lay in replay.layers})
    lines = describe(trace) + [
        *(f"  - {note}" for note in sizes.notes),
        f"expert size {' / '.join(format_size(u) for u in units)} ({units[0]} B), slot {slot}; "
        f"{len(replay)} layer forwards; tokens: prefill {replay.tokens[0] + replay.tokens[2]}, "
        f"decode {replay.tokens[1] + replay.tokens[3]}",
        f"halves: {replay.split}",
    ]
    index = {(r["policy"], r["budget_bytes"], r["phase"], r["scope"]): r for r in records}
    for phase in ("decode", "prefill"):
        for scope, title in (
            ("all", "whole trace"),
            ("second-half", "second half only (static's evaluation set)"),
        ):
            rows = [p for p in policies if (p, budgets[0], phase, scope) in index]
            if scope == "second-half" and "static" not in rows:
                continue
            if rows:
                lines += [
                    "",
                    f"{phase}, {title}: MiB read per token (hit rate)",
                    *_grid(index, rows, budgets, phase, scope),
                ]
        for policy in (p for p in PREFETCHING if p in policies and (p, budgets[0], phase, "all") in index):
            lines += [
                "",
                f"{phase}, {policy}: MiB/token read = waited for + prefetched; prefetches used",
                *_prefetch_grid(index, policy, budgets, phase),
            ]
    lines += [
        "",
        "opt is Belady's bound on the misses of the whole trace (it knows the future); within one "
        "phase or half another policy can come out below it.",
    ]
    return "\n".join(lines)


def _grid(
    index: dict[tuple[Any, ...], dict[str, Any]],
    policies: list[str],
    budgets: list[int],
    phase: str,
    scope: str,
) -> list[str]:
    head = f"{'policy':<16}" + "".join(f"{format_size(b):>20}" for b in budgets)
    out = [head]
    for policy in policies:
        cells = []
        for budget in budgets:
            r = index[(policy, budget, phase, scope)]
            cells.append(f"{r['mib_per_token']:>11.1f} ({r['hit_rate']:6.1%})")
        out.append(f"{policy:<16}" + "".join(f"{c:>20}" for c in cells))
    return out


def _prefetch_grid(
    index: dict[tuple[Any, ...], dict[str, Any]], policy: str, budgets: list[int], phase: str
) -> list[str]:
    out = [f"{'budget':<12}{'read':>10}{'waited':>10}{'prefetch':>10}{'used':>8}"]
    for budget in budgets:
        r = index[(policy, budget, phase, "all")]
        used = "-" if r["prefetch_used_fraction"] is None else f"{r['prefetch_used_fraction']:.0%}"
        out.append(
            f"{format_size(budget):<12}{r['mib_per_token']:>10.1f}{r['wait_mib_per_token']:>10.1f}"
            f"{r['prefetch_mib_per_token']:>10.1f}{used:>8}"
        )
    return out


def predict_table(records: list[dict[str, Any]], trace: Trace) -> str:
    """The predict-eval report: recall per metric and phase."""
    lines = describe(trace)
    if not any(r["metric"].startswith("stale gate") for r in records):
        lines.append(
            "this trace has no stale-gate predictions (recorded by `--trace` on a real run); "
            "only the previous-token baseline is shown"
        )
    if not records:
        lines.append("nothing to evaluate: no predictions, and token order within requests is unknown")
        return "\n".join(lines)
    lines += ["", f"{'guess':<34}{'phase':<9}{'recall':>8}{'rows':>10}"]
    for r in records:
        flag = "  (upper bound: synthetic)" if r["upper_bound"] else ""
        lines.append(f"{r['metric']:<34}{r['phase']:<9}{r['recall']:>8.1%}{r['rows']:>10}{flag}")
    lines += [
        "",
        "recall = share of the layer's actual top-k found in the guess; seed's real model "
        "(Qwen3.6-35B-A3B): stale gate 80.5% at top-8, 91.2% top-12, 94.8% top-16, 74.1% two ahead",
    ]
    return "\n".join(lines)

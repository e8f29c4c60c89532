"""`moestream plan`'s table (rich) and plot (matplotlib): predicted decode speed and MiB read per token
against the cache budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moestream.bench.plan import PlanRow
from moestream.units import GiB, format_size


def plan_table(rows: list[PlanRow], title: str) -> Any:
    """A rich Table, one row per budget."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name in (
        "budget",
        "slots",
        "hit rate",
        "MiB/token",
        "read ms",
        "compute ms",
        "ms/token",
        "tok/s",
    ):
        table.add_column(name, justify="left" if name == "budget" else "right")
    table.add_column("tok/s if overlapped", justify="right")
    for r in rows:
        budget = format_size(r.budget_bytes) + (f" ({r.label})" if r.label else "")
        table.add_row(
            budget,
            str(r.slots),
            f"{r.hit_rate:.1%}",
            _num(r.mib_per_token),
            _num(r.read_ms),
            _num(r.compute_ms),
            _num(r.ms),
            _num(r.tok_s),
            _num(r.overlap_tok_s),
        )
    return table


def _num(x: float) -> str:
    """One decimal from 10 up, three significant digits below (a tiny model's fractions of a ms)."""
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def print_table(rows: list[PlanRow], title: str, lines: list[str]) -> None:
    """The lines (inputs and notes), then the table, on stdout; plain text when stdout is not a terminal."""
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:  # piped: as wide as the table needs, not 80 columns
        console = Console(highlight=False, width=200)
    for line in lines:
        console.print(line, markup=False)
    console.print(plan_table(rows, title))


def plot_plan(rows: list[PlanRow], out: str | Path, title: str) -> None:
    """Two panels against the budget (log scale): predicted tok/s (serial, and overlapped as a bound),
    and MiB read per token; the labelled budgets (auto, all experts) are annotated."""
    import matplotlib  # imported here: only `--plot` pays for matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.budget_bytes / GiB for r in rows]
    fig, (speed, volume) = plt.subplots(1, 2, figsize=(12.0, 4.6))
    speed.plot(xs, [r.tok_s for r in rows], "-o", color="C0", label="predicted (compute + read)")
    speed.plot(xs, [r.overlap_tok_s for r in rows], "--", color="C1", label="bound: reads fully overlapped")
    speed.set_ylabel("decode tok/s")
    volume.plot(xs, [r.mib_per_token for r in rows], "-o", color="C2", label="MiB read per token")
    volume.set_ylabel("MiB read per decoded token")
    for ax, key in ((speed, "tok_s"), (volume, "mib_per_token")):
        for r in rows:
            if r.label:
                ax.annotate(
                    r.label,
                    (r.budget_bytes / GiB, getattr(r, key)),
                    textcoords="offset points",
                    xytext=(0, 8),
                    ha="center",
                    fontsize=8,
                )
        ax.set_xscale("log", base=2)
        labels = [format_size(r.budget_bytes).replace(".0 ", " ") for r in rows]
        ax.set_xticks(xs, labels, fontsize=7, rotation=35, ha="right")  # close budgets' labels stay apart
        ax.minorticks_off()
        ax.set_xlabel("expert cache budget (log scale)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)

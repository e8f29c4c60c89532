"""PNG of MiB read per token against cache budget, one line per policy (decode, and prefill beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moestream.units import GiB, format_size


def plot_curves(records: list[dict[str, Any]], out: str | Path, title: str, synthetic: bool = False) -> None:
    """Write the curves of `records` (whole-trace scope; static's second-half scope) to `out`."""
    import matplotlib  # imported here: only `--plot` pays for matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in ("decode", "prefill") if any(r["phase"] == p for r in records)]
    policies = list(dict.fromkeys(r["policy"] for r in records))
    colour = {p: f"C{i}" for i, p in enumerate(policies)}  # the same colour for a policy in both panels
    budgets = sorted({r["budget_bytes"] for r in records})
    fig, axes = plt.subplots(1, len(phases), figsize=(6.4 * len(phases), 4.6), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for policy in policies:
            scope = "second-half" if policy == "static" else "all"
            pts = sorted(
                (r["budget_bytes"] / GiB, r["mib_per_token"])
                for r in records
                if r["policy"] == policy and r["phase"] == phase and r["scope"] == scope
            )
            if pts:
                label = (
                    policy
                    + (" (2nd half)" if policy == "static" else "")
                    + (" (bound)" if policy == "opt" else "")
                )
                style = "--" if policy == "opt" else "-"
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    marker="o",
                    label=label,
                    color=colour[policy],
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            [b / GiB for b in budgets], [format_size(b).replace(".0 ", " ") for b in budgets], fontsize=8
        )
        ax.minorticks_off()
        ax.set_xlabel("cache budget (log scale)")
        ax.set_ylabel("MiB read per token")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{phase}" + (" - synthetic: upper bound" if synthetic else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)

"""PNG plots of a bench run: decode speed per request, and time per token against MiB read per token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moestream.bench.fit import LineFit


def _pyplot() -> Any:
    import matplotlib  # imported here: only a run that writes plots pays for matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_decode(results: dict[str, Any], out: str | Path) -> None:
    """Bars of decode tok/s per request (Korean and English prompts coloured apart), the mean as a line."""
    plt = _pyplot()
    requests = results["requests"]
    fig, ax = plt.subplots(figsize=(7.2, 3.8))
    colours = ["C0" if r["lang"] == "ko" else "C1" if r["lang"] == "en" else "C2" for r in requests]
    ax.bar([r["index"] + 1 for r in requests], [r["decode_tok_s"] for r in requests], color=colours)
    mean = results["summary"]["decode_tok_s_mean"]
    if mean is not None:
        ax.axhline(mean, color="k", linestyle="--", linewidth=1, label=f"mean {mean:.2f} tok/s")
        ax.legend(fontsize=8)
    ax.set_xlabel("request (blue: Korean, orange: English)")
    ax.set_ylabel("decode tok/s (server-reported)")
    ax.set_xticks([r["index"] + 1 for r in requests])
    ax.set_title(results["label"], fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_fit(
    points: list[tuple[str, float, float]], fit: LineFit | None, out: str | Path, title: str
) -> None:
    """Scatter of (MiB/token, ms/token), one colour per run, with the fitted line over x = 0 .. max."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, label in enumerate(dict.fromkeys(p[0] for p in points)):
        xs = [p[1] for p in points if p[0] == label]
        ys = [p[2] for p in points if p[0] == label]
        ax.scatter(xs, ys, s=18, color=f"C{i}", label=label)
    if fit is not None:
        x_end = max(p[1] for p in points) * 1.05
        ax.plot(
            [0, x_end],
            [fit.fixed_ms, fit.predict(x_end)],
            "k--",
            linewidth=1,
            label=f"{fit.fixed_ms:.0f} ms + {fit.ms_per_mib:.3f} ms/MiB (R^2 {fit.r2:.3f})",
        )
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("MiB read from the disk per decoded token")
    ax.set_ylabel("ms per decoded token")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)

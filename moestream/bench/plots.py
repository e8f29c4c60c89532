"""PNG plots of a bench run: decode speed per request, and time per token against MiB read per token.

Each figure is titled with the model and the configuration (`run_title`), the fit plot has one
legend entry per run label, the axes always contain every point, and prompts are coloured by language
only where the language is known.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moestream.bench.fit import LineFit

LANGUAGES = {"ko": ("C0", "Korean"), "en": ("C1", "English")}
UNKNOWN_COLOUR = "C7"
MARGIN = 0.05  # of the data range, so markers on the extremes are drawn whole


def _pyplot() -> Any:
    import matplotlib  # imported here: only a run that writes plots pays for matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def decode_figure(results: dict[str, Any]) -> Any:
    """Bars of decode tok/s per request, the mean as a line; the figure, for `plot_decode` and tests."""
    from matplotlib.patches import Patch

    plt = _pyplot()
    requests = results["requests"]
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    langs = [r.get("lang") if r.get("lang") in LANGUAGES else None for r in requests]
    colours = [LANGUAGES[lang][0] if lang else UNKNOWN_COLOUR for lang in langs]
    speeds = [r["decode_tok_s"] for r in requests]
    ax.bar([r["index"] + 1 for r in requests], speeds, color=colours)
    handles = [
        Patch(color=LANGUAGES[lang][0], label=LANGUAGES[lang][1]) for lang in LANGUAGES if lang in langs
    ]
    mean = results["summary"]["decode_tok_s_mean"]
    if mean is not None:
        handles.append(
            ax.axhline(mean, color="k", linestyle="--", linewidth=1, label=f"mean {mean:.2f} tok/s")
        )
    if handles:
        ax.legend(handles=handles, fontsize=8)
    ax.set_xlabel("request")
    ax.set_ylabel("decode tok/s (server-reported)")
    ax.set_xticks([r["index"] + 1 for r in requests])
    ax.set_ylim(0, max(speeds, default=1.0) * (1 + MARGIN) or 1.0)
    ax.set_title(run_title(results), fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_decode(results: dict[str, Any], out: str | Path) -> None:
    """Write `decode_figure(results)` to `out`."""
    fig = decode_figure(results)
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)


def fit_figure(points: list[tuple[str, float, float]], fit: LineFit | None, title: str) -> Any:
    """Scatter of (MiB/token, ms/token), one colour and legend entry per run label, with the fitted line
    over x = 0 .. max; the limits hold every point and the line's ends."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for i, label in enumerate(dict.fromkeys(p[0] for p in points)):
        xs = [p[1] for p in points if p[0] == label]
        ys = [p[2] for p in points if p[0] == label]
        ax.scatter(xs, ys, s=18, color=f"C{i}", label=label)
    x_end = max(p[1] for p in points) * (1 + MARGIN) or 1.0
    ys = [p[2] for p in points]
    if fit is not None:
        line = [fit.fixed_ms, fit.predict(x_end)]
        note = "" if fit.warning is None else " (no ceiling: see the report)"
        ax.plot(
            [0, x_end],
            line,
            "k--",
            linewidth=1,
            label=f"{fit.fixed_ms:.0f} ms + {fit.ms_per_mib:.3f} ms/MiB (R^2 {fit.r2:.3f}){note}",
        )
        ys += line
    low, high = min(0.0, min(ys)), max(ys)
    pad = MARGIN * (high - low or 1.0)
    ax.set_xlim(-MARGIN * x_end, x_end * (1 + MARGIN))
    ax.set_ylim(low - (pad if low < 0 else 0), high + pad)
    ax.set_xlabel("MiB read from the disk per decoded token")
    ax.set_ylabel("ms per decoded token")
    ax.set_title(title, fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_fit(
    points: list[tuple[str, float, float]], fit: LineFit | None, out: str | Path, title: str
) -> None:
    """Write `fit_figure(...)` to `out`."""
    fig = fit_figure(points, fit, title)
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)


def run_title(results: dict[str, Any], others: list[dict[str, Any]] | None = None) -> str:
    """A plot title naming the model and the configuration: label and model, then the engine's mode
    (io, cache) or the server kind, the tokens per request and the memory limit."""
    parts = [p.removeprefix("moestream: ") for p in (results.get("mode_line") or "").split(" | ") if p]
    config = "; ".join(parts[:3]) if parts else results.get("server", "server")
    limit = results.get("machine", {}).get("cgroup", {}).get("limit_text")
    settings = results.get("settings", {})
    tail = f"{settings.get('max_tokens')} tokens per request" + (f", memory limit {limit}" if limit else "")
    label = results.get("label", "")
    if others:
        label += " with " + ", ".join(o.get("label", "") for o in others)
    model = results.get("model") or "model not recorded"
    return f"{label}: {model}\n{config}\n{tail}"

"""Bench numbers that cannot mislead: no ceiling (and a warning) from a fit with a negative slope or a
ceiling below a measured run; plots titled with the model and configuration, one legend entry per run,
every point inside the axes, and language colours only for known languages."""

from __future__ import annotations

import pytest

from moestream.bench.fit import fit_line
from moestream.bench.plots import decode_figure, fit_figure, run_title
from moestream.bench.report import summary_lines

MODE = (
    "moestream: qwen3_moe on cpu | io direct, 4 io threads, 128 KiB pieces | cache 1.0 GiB = 113 slots | "
    "threads 2 | dtype bfloat16"
)


def test_negative_slope_and_low_ceiling_give_no_ceiling():
    falling = fit_line([100.0, 200.0, 300.0], [300.0, 200.0, 100.0])
    assert falling.ceiling_tok_s is None and "slope is negative" in falling.warning
    assert "ceiling with no reads none (WARNING: the fitted slope is negative" in falling.line()
    # the line crosses zero reads at 250 ms/token (4 tok/s) but one run made 10 ms/token: no ceiling
    low = fit_line([0.0, 10.0, 100.0, 110.0], [10.0, 490.0, 300.0, 320.0])
    assert low.ms_per_mib >= 0 and low.fixed_ms > 10
    assert low.ceiling_tok_s is None and "below a measured run" in low.warning
    good = fit_line([100.0, 200.0, 300.0], [150.0, 250.0, 350.0])
    assert good.warning is None and good.ceiling_tok_s == pytest.approx(20.0)
    results = {
        "summary": {
            "decode_tok_s_mean": 1.0,
            "decode_tok_s_cv": None,
            "decode_tok_s_min": 1.0,
            "decode_tok_s_max": 1.0,
            "prefill_tok_s_mean": 1.0,
            "prompt_s_total": 1.0,
            "device_gib": None,
            "mib_per_token_mean": None,
            "generated_tokens": 3,
        },
        "fit": falling.to_dict(),
        "fit_runs": ["a"],
    }
    fit_line_text = next(line for line in summary_lines(results) if line.startswith("fit:"))
    assert "WARNING" in fit_line_text and "tok/s" not in fit_line_text.split("ceiling")[1]


def _results(langs: list[str]) -> dict:
    requests = [{"index": i, "lang": lang, "decode_tok_s": 2.0 + i} for i, lang in enumerate(langs)]
    return {
        "label": "direct",
        "model": "Qwen3-30B-A3B",
        "mode_line": MODE,
        "server": "moestream",
        "requests": requests,
        "summary": {"decode_tok_s_mean": 3.0},
        "settings": {"max_tokens": 256},
        "machine": {"cgroup": {"limit_text": "2.6 GiB"}},
    }


def _legend(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def test_plots_name_the_run_and_keep_every_point():
    import matplotlib.pyplot as plt

    title = run_title(_results(["ko"]))
    assert (
        title.startswith("direct: Qwen3-30B-A3B")
        and "cache 1.0 GiB" in title
        and "memory limit 2.6 GiB" in title
    )
    fig = decode_figure(_results(["ko", "ko", "en"]))
    ax = fig.axes[0]
    assert ax.get_title() == title and _legend(ax) == ["Korean", "English", "mean 3.00 tok/s"]
    assert ax.get_ylim()[1] > 4.0  # the tallest bar (4 tok/s) is inside
    plt.close(fig)
    fig = decode_figure(_results(["de", "custom", "de"]))  # a prompts file without known languages
    assert _legend(fig.axes[0]) == ["mean 3.00 tok/s"] and "Korean" not in fig.axes[0].get_xlabel()
    plt.close(fig)

    points = [("direct", 0.0, 100.0), ("direct", 400.0, 350.0), ("k4", 200.0, 230.0), ("k4", 210.0, 240.0)]
    fit = fit_line([p[1] for p in points], [p[2] for p in points])
    fig = fit_figure(points, fit, "t")
    ax = fig.axes[0]
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    assert all(x0 < x < x1 and y0 < y < y1 for _, x, y in points)
    assert _legend(ax)[:2] == ["direct", "k4"] and len(_legend(ax)) == 3
    plt.close(fig)

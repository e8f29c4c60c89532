"""The decode-time model on known points, summary statistics, and fits across runs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from moestream.bench.fit import cv, fit_line, mean
from moestream.bench.report import fit_runs, summarise


def test_exact_line_is_recovered_with_its_ceiling():
    # the seed's figures: 193 ms fixed + 0.64 ms per MiB, over top-k 8 and top-k 4 volumes
    xs = [150.0, 160.0, 175.0, 190.0, 380.0, 395.0, 410.0, 420.0]
    fit = fit_line(xs, [193 + 0.64 * x for x in xs])
    assert fit.fixed_ms == pytest.approx(193, rel=1e-12)
    assert fit.ms_per_mib == pytest.approx(0.64, rel=1e-12)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.ceiling_tok_s == pytest.approx(1000 / 193)
    assert (fit.points, fit.x_min, fit.x_max) == (8, 150.0, 420.0)
    assert fit.predict(0) == pytest.approx(193)


def test_noisy_line_matches_numpy_least_squares():
    rng = random.Random(7)
    xs = [rng.uniform(100, 800) for _ in range(24)]
    ys = [250 + 0.5 * x + rng.gauss(0, 20) for x in xs]
    fit = fit_line(xs, ys)
    slope, intercept = np.polyfit(xs, ys, 1)
    r = np.corrcoef(xs, ys)[0, 1]
    assert fit.ms_per_mib == pytest.approx(slope, rel=1e-9)
    assert fit.fixed_ms == pytest.approx(intercept, rel=1e-9)
    assert fit.r2 == pytest.approx(r * r, rel=1e-9)
    assert 0.9 < fit.r2 < 1.0


def test_degenerate_inputs_give_no_fit():
    assert fit_line([1.0, 2.0], [3.0, 4.0]) is None  # too few points
    assert fit_line([5.0] * 6, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) is None  # one read volume: no slope
    with pytest.raises(ValueError):
        fit_line([1.0, 2.0, 3.0], [1.0, 2.0])


def test_negative_fixed_part_has_no_ceiling():
    fit = fit_line([1.0, 2.0, 3.0], [0.0, 2.0, 4.0])
    assert fit.fixed_ms == pytest.approx(-2.0)
    assert fit.ceiling_tok_s is None
    assert "none" in fit.line()


def test_mean_and_coefficient_of_variation():
    assert mean([]) is None and cv([3.0]) is None
    assert mean([1.0, 2.0, 3.0]) == 2.0
    assert cv([1.0, 2.0, 3.0]) == pytest.approx(0.5)  # sample std 1 / mean 2
    assert cv([2.73, 2.8, 2.61, 2.9]) == pytest.approx(
        np.std([2.73, 2.8, 2.61, 2.9], ddof=1) / np.mean([2.73, 2.8, 2.61, 2.9])
    )


def _request(i: int, mib: float | None, ms: float) -> dict:
    return {
        "index": i,
        "decode_tok_s": 1000 / ms,
        "prefill_tok_s": 5.0,
        "prompt_ms": 4000.0,
        "predicted_n": 65,
        "ms_per_token": ms,
        "mib_per_token": mib,
        "device_bytes": None if mib is None else int(mib * 64 * (1 << 20)),
    }


def test_fit_spans_two_runs_and_skips_uncounted_requests():
    run8 = {
        "label": "top-k 8",
        "requests": [_request(i, 560 + 4 * i, 193 + 0.64 * (560 + 4 * i)) for i in range(12)],
    }
    run4 = {
        "label": "top-k 4",
        "requests": [_request(i, 280 + 3 * i, 193 + 0.64 * (280 + 3 * i)) for i in range(12)],
    }
    run4["requests"].append(_request(12, None, 999.0))  # no disk counter: not a point
    fit, points = fit_runs([run8, run4])
    assert len(points) == 24 and {p[0] for p in points} == {"top-k 8", "top-k 4"}
    assert fit.fixed_ms == pytest.approx(193) and fit.ms_per_mib == pytest.approx(0.64)


def test_summary_totals_and_cv():
    rows = [_request(i, 100.0, ms) for i, ms in enumerate([200.0, 250.0, 400.0])]
    s = summarise(rows)
    decode = [5.0, 4.0, 2.5]
    assert s["decode_tok_s_mean"] == pytest.approx(sum(decode) / 3)
    assert s["decode_tok_s_cv"] == pytest.approx(np.std(decode, ddof=1) / np.mean(decode))
    assert s["prompt_s_total"] == pytest.approx(12.0)
    assert s["generated_tokens"] == 195
    assert s["device_gib"] == pytest.approx(3 * 100 * 64 / 1024)
    assert math.isclose(s["mib_per_token_mean"], 100.0)


def test_one_read_volume_gives_no_fit_but_keeps_the_points():
    run = {"label": "k8", "requests": [_request(i, 750 + (i % 3), 600 + 10 * (i % 4)) for i in range(12)]}
    fit, points = fit_runs([run])
    assert fit is None and len(points) == 12


def test_no_reads_at_all_gives_no_fit():
    run = {"label": "resident", "requests": [_request(i, 0.0, 140 + (i % 3)) for i in range(12)]}
    fit, points = fit_runs([run])
    assert fit is None and len(points) == 12

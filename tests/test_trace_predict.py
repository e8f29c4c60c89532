"""Predictor evaluation: hand-computed recall for the stale gate (one and two layers ahead) and previous
token."""

from __future__ import annotations

import numpy as np
import pytest

from moestream.trace.predict import evaluate
from moestream.trace.schema import TraceHeader
from moestream.trace.synthetic import random_trace
from moestream.trace.table import Trace


def three_layer_trace(synthetic: bool = False) -> Trace:
    """One request, tokens 0 (prefill) and 1 (decode), 3 layers, top-2 of 8 experts."""
    experts = np.array(
        [
            [0, 1],
            [2, 3],
            [4, 5],  # token 0, layers 0..2
            [0, 2],
            [2, 6],
            [4, 7],
        ]
    )  # token 1
    # found in the top-2/3/4 guess: token 0: L1 {2,3} 1/2/2, L2 {4,5} 1/1/2; token 1: L1 {2,6} 1/1/2, L2
    # {4,7} 1/2/2
    pred = np.array([[2, 7, 3, 0], [4, 0, 1, 5], [-1] * 4, [6, 1, 0, 2], [7, 5, 4, 1], [-1] * 4])
    pred2 = np.array([[4, 1], [-1, -1], [-1, -1], [7, 4], [-1, -1], [-1, -1]])  # L2 from L0: 1/2, 2/2
    return Trace(
        header=TraceHeader("t", 3, 8, 2, synthetic=synthetic),
        request=np.zeros(6, np.int32),
        request_names=["r"],
        token=np.repeat([0, 1], 3),
        phase=np.repeat([0, 1], 3).astype(np.int8),
        layer=np.tile([0, 1, 2], 2).astype(np.int32),
        step=np.repeat([0, 1], 3),
        experts=experts,
        weights=np.full((6, 2), 0.5, np.float32),
        pred_experts=pred,
        pred_scores=np.ones((6, 4)),
        pred2_experts=pred2,
        pred2_scores=np.ones((6, 2)),
    )


def recall(records, metric_start, phase):
    return next(r for r in records if r["metric"].startswith(metric_start) and r["phase"] == phase)


def test_hand_computed_recalls() -> None:
    records = evaluate(three_layer_trace())
    assert recall(records, "stale gate L+1, top-2 ", "prefill")["recall"] == pytest.approx(2 / 4)
    assert recall(records, "stale gate L+1, top-3 ", "prefill")["recall"] == pytest.approx(3 / 4)
    assert recall(records, "stale gate L+1, top-4 ", "prefill")["recall"] == pytest.approx(4 / 4)
    assert recall(records, "stale gate L+1, top-2 ", "decode")["recall"] == pytest.approx(2 / 4)
    assert recall(records, "stale gate L+1, top-3 ", "decode")["recall"] == pytest.approx(3 / 4)
    assert recall(records, "stale gate L+1, top-4 ", "decode")["recall"] == pytest.approx(4 / 4)
    assert recall(records, "stale gate L+2", "prefill")["recall"] == pytest.approx(1 / 2)
    assert recall(records, "stale gate L+2", "decode")["recall"] == pytest.approx(2 / 2)
    prev = recall(records, "previous token", "decode")  # {0,1}->{0,2}: 1, {2,3}->{2,6}: 1, {4,5}->{4,7}: 1
    assert (prev["matched"], prev["rows"], prev["recall"]) == (3, 3, pytest.approx(3 / 6))
    assert not [r for r in records if r["metric"].startswith("previous") and r["phase"] == "prefill"]
    assert not any(r["upper_bound"] for r in records)


def test_synthetic_traces_are_labelled_upper_bound() -> None:
    records = evaluate(three_layer_trace(synthetic=True))
    assert all(r["upper_bound"] for r in records if r["metric"].startswith("stale gate"))


def test_missing_next_layer_rows_are_not_counted() -> None:
    t = three_layer_trace()
    keep = np.array([True, False, True, True, True, True])  # token 0 loses its layer-1 row
    for name in (
        "request",
        "token",
        "phase",
        "layer",
        "step",
        "experts",
        "weights",
        "pred_experts",
        "pred_scores",
        "pred2_experts",
        "pred2_scores",
    ):
        setattr(t, name, getattr(t, name)[keep])
    records = evaluate(t)
    assert "prefill" not in {r["phase"] for r in records if r["metric"].startswith("stale gate L+1")}
    assert recall(records, "stale gate L+2", "prefill")["rows"] == 1  # L0 -> L2 still has its target


def test_noisier_predictions_recall_less() -> None:
    t = random_trace(n_layers=6, n_experts=32, top_k=4, n_requests=2, predictions=True, seed=3)
    records = evaluate(t)
    r_k, r_2k = (recall(records, f"stale gate L+1, top-{m} ", "decode")["recall"] for m in (4, 8))
    assert 0.2 < r_k < r_2k < 1.0  # widening the guess finds more, but the synthetic noise keeps it imperfect

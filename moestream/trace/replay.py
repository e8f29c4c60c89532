"""A trace in execution order, as the expert cache sees it: one list of keys per layer forward.

Order: forwards sorted by (step, layer) (`side_by_side`: a round's forwards by (layer, step), as the
engine runs them where it streams experts); inside one forward, rows keep their recorded order (token
order), and the keys are `[(layer, e) for e in execution_order(rows)]`, the distinct experts in first
appearance order, exactly what the engine hands `ResidentSet.access_group`. So a prefill forward
touches each distinct expert of its layer once, and decode goes token by token, layer by layer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from moestream.cache.policy import execution_order
from moestream.trace.errors import TraceError
from moestream.trace.table import Trace

Key = tuple[int, int]


@dataclass
class Replay:
    """Per-forward lists (index i = the i-th forward in execution order).

    Attributes:
        keys: distinct (layer, expert) keys of each forward, in execution order.
        layer: the forward's layer.
        cell: 2 * half + phase, where half 1 is the second half (static pinning's evaluation set) and
            phase 1 is decode; the simulator's counters are indexed by it.
        predicted: for forwards followed by the same step's next layer, the keys of that next layer that
            the stale-gate prediction names (top-n per token, union in order); None otherwise.
        tokens: [4] tokens per cell (distinct (request, token) pairs), the denominators of MiB/token.
        split: how the trace was cut in halves, for the report.
        layers: layers present in the trace.
        n_experts: experts per layer (the header's).
        uses: for policies that learn from routing, per forward the number of its rows (tokens) routed
            to each of its keys, and its number of rows; None unless asked for.
    """

    keys: list[list[Key]]
    layer: list[int]
    cell: list[int]
    predicted: list[list[Key] | None] | None
    tokens: list[int]
    split: str
    layers: list[int]
    n_experts: int = 0
    uses: list[tuple[list[int], int]] | None = None

    def __len__(self) -> int:
        return len(self.keys)


def split_halves(trace: Trace) -> tuple[np.ndarray, str]:
    """Row -> 0 (first half) or 1 (second half): by request when there are several with known order,
    else by forward step. Returns (half per row, a description)."""
    n_req = len(trace.request_names)
    if n_req >= 2 and trace.header.token_order_known:
        first_row = np.full(n_req, len(trace), dtype=np.int64)
        np.minimum.at(first_row, trace.request, np.arange(len(trace)))
        rank = np.empty(n_req, dtype=np.int64)
        rank[np.argsort(first_row, kind="stable")] = np.arange(n_req)
        cut = n_req // 2
        return (rank[trace.request] >= cut).astype(
            np.int8
        ), f"requests 1-{cut} / {cut + 1}-{n_req} (of {n_req})"
    steps = np.unique(trace.step)
    cut = steps[len(steps) // 2]
    return (trace.step >= cut).astype(np.int8), f"forward steps before / from step {cut} (of {len(steps)})"


def build_replay(
    trace: Trace,
    prefetch_top: int | None = None,
    uses: bool = False,
    min_score: float = 0.0,
    side_by_side: bool = False,
) -> Replay:
    """Group a trace's rows into layer forwards in execution order (see the module docstring).

    Args:
        prefetch_top: how many predicted experts per token to prefetch; None skips predictions.
        min_score: prefetch only predicted experts whose stale-gate softmax score is at least this.
        uses: also count, per forward, the rows routed to each key (`Replay.uses`).
        side_by_side: where the trace says each forward's round (`Trace.round`), a round's forwards in
            the engine's side-by-side order: layer by layer, each layer's forwards in step order.
    """
    check_ids(trace)
    n, n_exp = len(trace), trace.header.n_experts
    half, split = split_halves(trace)
    if side_by_side and trace.round is not None:
        order = np.lexsort((np.arange(n), trace.step, trace.layer, trace.round))
    else:
        order = np.lexsort((np.arange(n), trace.layer, trace.step))
    step_s, layer_s = trace.step[order], trace.layer[order]
    change = np.flatnonzero((np.diff(step_s) != 0) | (np.diff(layer_s) != 0)) + 1
    starts = np.concatenate([[0], change]).tolist()
    ends = np.concatenate([change, [n]]).tolist()
    layers = layer_s[starts].tolist()
    layer_keys = {lay: [(lay, e) for e in range(n_exp)] for lay in set(layers) | {x + 1 for x in layers}}
    rows = trace.experts[order].tolist()
    keys = []
    counts: list[tuple[list[int], int]] | None = [] if uses else None
    for a, b, lay in zip(starts, ends, layers):
        table = layer_keys[lay]
        distinct = dict.fromkeys(rows[a]) if b - a == 1 else execution_order(rows[a:b])
        keys.append([table[e] for e in distinct])
        if counts is not None:
            counts.append(([1] * len(distinct), 1) if b - a == 1 else (_uses(rows[a:b], distinct), b - a))
    cell = (2 * half[order][starts] + trace.phase[order][starts]).tolist()
    predicted = None
    if prefetch_top and trace.pred_experts is not None:
        pred = trace.pred_experts[order][:, :prefetch_top]
        if min_score > 0 and trace.pred_scores is not None:
            pred = np.where(trace.pred_scores[order][:, :prefetch_top] >= min_score, pred, -1)
        predicted = _predictions(pred, starts, ends, step_s, layers, layer_keys, n_exp)
    return Replay(
        keys, layers, cell, predicted, _token_counts(trace, half), split, sorted(set(layers)), n_exp, counts
    )


def _uses(rows: list[list[int]], distinct: Iterable[int]) -> list[int]:
    """How many of `rows` route to each of `distinct` (a row names an expert at most once)."""
    count: Counter[int] = Counter()
    for row in rows:
        count.update(row)
    return [count[e] for e in distinct]


def check_ids(trace: Trace) -> None:
    """Refuse an empty trace, and layer, expert or predicted-expert ids outside what the header declares
    (-1 pads a prediction row), naming the first row at fault."""
    name = trace.header.source or trace.header.model_id
    if len(trace) == 0:
        raise TraceError(f"the trace {name} holds no rows")
    h = trace.header
    columns = [
        ("expert", trace.experts, 0, h.n_experts, "expert"),
        ("layer", trace.layer, 0, h.n_layers, "layer"),
    ]
    columns += [
        (f"predicted expert ({col})", getattr(trace, col), -1, h.n_experts, "expert")
        for col in ("pred_experts", "pred2_experts")
        if getattr(trace, col) is not None
    ]
    for what, ids, low, bound, noun in columns:
        bad = (ids < low) | (ids >= bound)
        if bad.any():
            row = int(np.flatnonzero(bad.reshape(len(trace), -1).any(axis=1))[0])
            value = int(ids[row][bad[row]][0]) if ids.ndim > 1 else int(ids[row])
            request = trace.request_names[trace.request[row]]
            raise TraceError(
                f"the trace {name} has {what} id {value} at row {row} (request {request!r}, "
                f"token {int(trace.token[row])}, layer {int(trace.layer[row])}), outside "
                f"0..{bound - 1} (the header's {bound} {noun}s)"
            )


def _predictions(
    pred: np.ndarray,
    starts: list[int],
    ends: list[int],
    step_s: np.ndarray,
    layers: list[int],
    layer_keys: dict[int, list[Key]],
    n_exp: int,
) -> list[list[Key] | None]:
    """Keys of layer+1 named by each forward's predictions, where the next forward is that layer."""
    rows = np.where(pred < n_exp, pred, -1).tolist()
    out: list[list[Key] | None] = []
    for i, (a, b, lay) in enumerate(zip(starts, ends, layers)):
        nxt = i + 1
        if nxt == len(starts) or layers[nxt] != lay + 1 or step_s[starts[nxt]] != step_s[a]:
            out.append(None)
            continue
        table = layer_keys[lay + 1]
        out.append([table[e] for e in execution_order(rows[a:b]) if e >= 0])
    return out


def _token_counts(trace: Trace, half: np.ndarray) -> list[int]:
    """Distinct (request, token) pairs per cell (2 * half + phase)."""
    pair = trace.request.astype(np.int64) * (int(trace.token.max()) + 1) + trace.token
    cell = 2 * half.astype(np.int64) + trace.phase
    return [int(np.unique(pair[cell == c]).size) for c in range(4)]

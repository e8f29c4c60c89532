"""How well the next layers' experts can be guessed before their router runs.

Stale gate (recorded by the engine): layer L+1's router applied to layer L's router input; its top-2k
are stored on layer L's row. Recall at top-m = |predicted top-m ∩ actual top-k of L+1| / k, over every
(request, token) row whose L+1 row exists; "two ahead" does the same with layer L+2's router.
Previous token (needs no recording): the experts token t-1 used at layer L, as a guess for token t.

On synthetic checkpoints the residual stream barely changes between layers, so the stale-gate figures
are an upper bound, not an estimate (99% top-8 on a synthetic 12-layer Qwen3-MoE shape vs 80.5% on the
seed's real model); every record carries `upper_bound` so no report can drop that label.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moestream.trace.replay import check_ids
from moestream.trace.schema import PHASES
from moestream.trace.table import Trace


def _row_keys(trace: Trace) -> tuple[np.ndarray, int]:
    """Composite key (request, token, layer) of every row, and the stride of one token in it."""
    n_tok = int(trace.token.max()) + 3  # room for token + 1 lookups that must miss
    n_lay = int(trace.layer.max()) + 3  # room for layer + 2
    return (trace.request.astype(np.int64) * n_tok + trace.token) * n_lay + trace.layer, n_lay


def _lookup(keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Row index holding each wanted composite key, or -1."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    pos = np.minimum(np.searchsorted(sorted_keys, wanted), len(keys) - 1)
    return np.where(sorted_keys[pos] == wanted, order[pos], -1)


def overlap(guess: np.ndarray, actual: np.ndarray, chunk: int = 65536) -> int:
    """How many of `actual`'s experts appear in `guess`, summed over rows ([R, m] and [R, k]; -1 never
    matches). Chunked so the [R, m, k] comparison stays small."""
    total = 0
    for a in range(0, len(guess), chunk):
        g, t = guess[a : a + chunk, :, None], actual[a : a + chunk, None, :]
        total += int(((g == t) & (t >= 0)).any(axis=1).sum())
    return total


def evaluate(trace: Trace) -> list[dict[str, Any]]:
    """Recall records: {metric, phase, k, guess_size, recall, matched, rows, upper_bound}."""
    check_ids(trace)
    k = trace.header.top_k
    key, n_lay = _row_keys(trace)
    out: list[dict[str, Any]] = []
    for ahead, guesses in ((1, trace.pred_experts), (2, trace.pred2_experts)):
        if guesses is None:
            continue
        target = _lookup(key, key + ahead)
        for m in (k, int(round(1.5 * k)), 2 * k) if ahead == 1 else (k,):
            if m <= guesses.shape[1]:
                label = f"stale gate L+{ahead}, top-{m}" + (f" ({m / k:g}k)" if m != k else " (k)")
                out += _records(trace, label, m, guesses[:, :m], target, trace.header.synthetic)
    if trace.header.token_order_known:
        # decode only: in prefill the previous token runs in the same forward, so it predicts nothing
        prev = _lookup(key, key - n_lay)  # same request and layer, token - 1
        prev = np.where(trace.phase == 1, prev, -1)
        guess = np.where(prev[:, None] >= 0, trace.experts[np.maximum(prev, 0)], -1)
        own = np.where(prev >= 0, np.arange(len(trace)), -1)
        out += _records(trace, "previous token, same layer", k, guess, own, False)
    return out


def _records(
    trace: Trace, label: str, m: int, guess: np.ndarray, target: np.ndarray, upper_bound: bool
) -> list[dict[str, Any]]:
    """One record per phase: recall of the rows at `target` (-1 = no such row) by `guess`."""
    k = trace.header.top_k
    valid = (target >= 0) & (guess >= 0).any(axis=1)
    out = []
    for phase in (1, 0):
        rows = valid & (trace.phase == phase)
        if not rows.any():
            continue
        matched = overlap(guess[rows], trace.experts[target[rows]])
        total = int(rows.sum()) * k
        out.append(
            {
                "metric": label,
                "phase": PHASES[phase],
                "k": k,
                "guess_size": m,
                "recall": matched / total,
                "matched": matched,
                "rows": int(rows.sum()),
                "upper_bound": upper_bound,
            }
        )
    return out

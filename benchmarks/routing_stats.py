"""What a trace's routing tells a cache: reuse by the next token, by router rank and by recent use, and
how often stale-gate guesses are right by rank and by score (the facts the predictive policy and the
prefetch gate are built on; docs/traces.md).

    .venv/bin/python benchmarks/routing_stats.py TRACE [TRACE...]   (decode rows; one trace per model)
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np

from moestream.trace.reader import load_traces


def reuse(trace) -> list[str]:
    """P(an expert of token t is used again by token t+1 at the same layer), split three ways."""
    e, k = trace.header.n_experts, trace.header.top_k
    row = {
        (int(r), int(t), int(lay)): i
        for i, (r, t, lay) in enumerate(zip(trace.request, trace.token, trace.layer))
    }
    same = other = n_same = n_other = 0
    by_rank = np.zeros((k, 2))
    by_recent: dict[int, np.ndarray] = {}
    for i in np.flatnonzero(trace.phase == 1):
        r, t, lay = int(trace.request[i]), int(trace.token[i]), int(trace.layer[i])
        j = row.get((r, t + 1, lay))
        if j is None:
            continue
        now, nxt = trace.experts[i].tolist(), set(trace.experts[j].tolist())
        same += len(set(now) & nxt)
        n_same += len(now)
        other += len(nxt - set(now))
        n_other += e - len(now)
        past: Counter[int] = Counter()
        for dt in range(1, 9):
            earlier = row.get((r, t - dt, lay))
            if earlier is not None:
                past.update(trace.experts[earlier].tolist())
        for rank, expert in enumerate(now):
            by_rank[rank] += (expert in nxt, 1)
            by_recent.setdefault(min(past[expert], 8), np.zeros(2))[:] += (expert in nxt, 1)
    return [
        f"P(used by token t+1 | used by t) {same / n_same:.3f}; "
        f"P(used by t+1 | not used by t) {other / n_other:.3f}; k/E {k / e:.3f}",
        "  by router rank at t: " + " ".join(f"{a / b:.2f}" for a, b in by_rank),
        "  by uses in the 8 tokens before t: "
        + " ".join(f"{c}: {v[0] / v[1]:.2f}" for c, v in sorted(by_recent.items())),
    ]


def guesses(trace) -> list[str]:
    """Share of stale-gate guesses for layer L+1 (decode) that L+1 then uses, by rank and by score."""
    if trace.pred_experts is None:
        return ["no stale-gate predictions in this trace"]
    e = trace.header.n_experts
    row = {
        (int(r), int(t), int(lay)): i
        for i, (r, t, lay) in enumerate(zip(trace.request, trace.token, trace.layer))
    }
    width = trace.pred_experts.shape[1]
    by_rank = np.zeros((width, 2))
    edges = np.array([0, 1, 1.3, 2, 3, 4, 6, 8, 16, np.inf])  # x the uniform score 1/E
    by_score = np.zeros((len(edges) - 1, 2))
    for i in np.flatnonzero(trace.phase == 1):
        j = row.get((int(trace.request[i]), int(trace.token[i]), int(trace.layer[i]) + 1))
        if j is None:
            continue
        used = set(trace.experts[j].tolist())
        for rank, (expert, score) in enumerate(zip(trace.pred_experts[i], trace.pred_scores[i])):
            if expert >= 0:
                by_rank[rank] += (expert in used, 1)
                by_score[np.searchsorted(edges, score * e, side="right") - 1] += (expert in used, 1)
    return [
        "stale-gate guesses used by their layer, by rank: "
        + " ".join(f"{a / b:.2f}" for a, b in by_rank if b),
        "  by score (x uniform): "
        + " ".join(
            f"[{edges[c]:g},{edges[c + 1]:g}): {a / b:.2f} ({b / by_score[:, 1].sum():.0%})"
            for c, (a, b) in enumerate(by_score)
            if b
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    args = parser.parse_args()
    for path in args.traces:
        trace = load_traces([path])
        print(f"{path} ({'synthetic' if trace.header.synthetic else 'learned'} routing)")
        print("\n".join(["  " + line for line in reuse(trace) + guesses(trace)]))


if __name__ == "__main__":
    main()

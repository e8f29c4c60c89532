"""Routing replay: the engine takes each layer's experts (and stale-gate guesses) from a recorded trace.

Benchmark-only. A trace recorded on a small model with learned routing (the trained fixture) is
replayed on a synthetic checkpoint of real expert size with the same layers, experts and top-k, so the
I/O path (reads, cache, prefetch) runs learned routing at real byte sizes. The outputs are meaningless
(the experts the router did not pick are computed), so the mode line says so.

The engine calls `forward(request, phase, first_position)` before every model forward (as it does for
the trace recorder) and the runtime calls `route(layer, rows, weights)` once per layer forward; tokens
the trace has no row for keep the model's own routing. No torch here: lists in, lists out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moestream.trace.errors import TraceError
from moestream.trace.table import Trace


@dataclass(frozen=True)
class ReplayRequest:
    """One request of the trace: its id, prompt length and decode forwards (one per generated token but
    the last, which is never fed back)."""

    name: str
    prompt_tokens: int
    decode_tokens: int


class RoutingReplay:
    """Routing of every (request, token, layer) of a trace, looked up as the engine runs its requests."""

    def __init__(self, trace: Trace, name: str = "") -> None:
        h = trace.header
        self.name = name or h.source or h.model_id
        if not h.token_order_known:
            raise TraceError(f"the trace {self.name} does not record token order, so it cannot be replayed")
        self.trace, self.top_k = trace, h.top_k
        self._row = {
            (int(r), int(t), int(lay)): i
            for i, (r, t, lay) in enumerate(zip(trace.request, trace.token, trace.layer))
        }
        self._request_index = {name: i for i, name in enumerate(trace.request_names)}
        self._request, self._first = -1, 0
        self.replayed = self.own = 0  # token rows taken from the trace / left to the model's router

    def check(self, layers: Sequence[int], n_experts: int, top_k: int) -> None:
        """Refuse a checkpoint whose MoE layers, experts per layer or top-k differ from the trace's."""
        h, present = self.trace.header, sorted({int(x) for x in np.unique(self.trace.layer)})
        problems = []
        if h.n_experts != n_experts:
            problems.append(f"{h.n_experts} experts per layer, the checkpoint {n_experts}")
        if h.top_k != top_k:
            problems.append(f"top-{h.top_k} routing, the checkpoint top-{top_k}")
        if not set(present) <= set(layers):
            problems.append(f"MoE layers {present}, the checkpoint {sorted(layers)}")
        if problems:
            raise TraceError(f"the trace {self.name} cannot be replayed here: it has {'; '.join(problems)}")

    def requests(self) -> list[ReplayRequest]:
        """The trace's requests in order of first appearance."""
        t = self.trace
        out = []
        for i, name in enumerate(t.request_names):
            mine = t.request == i
            out.append(
                ReplayRequest(
                    name,
                    int(np.unique(t.token[mine & (t.phase == 0)]).size),
                    int(np.unique(t.token[mine & (t.phase == 1)]).size),
                )
            )
        return out

    def forward(self, request: str, phase: str, first_position: int) -> None:
        """The next model forward: which request (a trace request id) and token positions it covers."""
        self._request = self._request_index.get(request, -1)
        self._first = first_position

    def route(
        self, layer: int, rows: list[list[int]], weights: list[list[float]]
    ) -> tuple[list[list[int]], list[list[float]], list[list[tuple[int, float]]] | None]:
        """The forward's routing at `layer` with the trace's rows in place of the model's where the trace
        has them: (rows, weights, per replayed token its stale-gate guess for the next layer, top-k
        (expert, softmax score) pairs; None when the trace has no predictions here)."""
        t, k = self.trace, self.top_k
        rows, weights = list(rows), list(weights)
        guesses = []
        for offset in range(len(rows)):
            i = self._row.get((self._request, self._first + offset, layer))
            if i is None:
                self.own += 1
                continue
            self.replayed += 1
            rows[offset] = t.experts[i].tolist()
            weights[offset] = t.weights[i].tolist()
            if t.pred_experts is not None:
                scores = t.pred_scores[i, :k].tolist() if t.pred_scores is not None else [1.0] * k
                guess = t.pred_experts[i, :k].tolist()
                guesses.append([(e, s) for e, s in zip(guess, scores) if e >= 0])
        return rows, weights, guesses if any(guesses) else None

"""Several requests at once in a trace: its forwards regrouped as the engine's rounds run them with N
slots (`moestream simulate --parallel N`; `engine/batch.py` schedules the live ones).

Requests start in the order they first appear, each as soon as one of the N slots is free. A round is
one decode forward of every running request past its prompt (their rows then share one step: each
layer's forward touches the union of their experts, as the engine's batched step does) and then the
next prompt forwards (recorded prefill forwards, as the engine fed them) of the requests still in their
prompts, the longest waiting first, as many as one chunk's tokens hold (the first always), as the
engine's round feeds them. Rows keep their request, token and phase; `step` changes (a forward each), and
`round` says which round each forward ran in: where the engine streams experts it runs a round's
forwards side by side, a layer at a time (`GgmlRunner.together`), and the replay then takes them in that
order (`build_replay(..., side_by_side=True)`). A trace recorded with `--parallel` already holds such
steps (its rows say which request each is); regrouping it takes each request's forwards apart first, so
a trace of either kind can be replayed at any N.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from moestream.trace.table import Trace

DECODE = 1  # the phase code of decode rows (`PHASES`)
CHUNK = 256  # the prompt tokens a round of the engine feeds at most on the host (`engine/ggml_runner.py`)


def _forwards(trace: Trace) -> dict[int, list[np.ndarray]]:
    """Request -> the row indices of each of its forwards (rows of one step), in step order."""
    order = np.lexsort((np.arange(len(trace)), trace.step, trace.request))
    request, step = trace.request[order], trace.step[order]
    cut = np.flatnonzero((np.diff(request) != 0) | (np.diff(step) != 0)) + 1
    out: dict[int, list[np.ndarray]] = {}
    for rows in np.split(order, cut):
        out.setdefault(int(trace.request[rows[0]]), []).append(rows)
    return out


def batch_steps(trace: Trace, slots: int, chunk: int = CHUNK) -> Trace:
    """`trace` with each row's step set to its forward's when `slots` requests run at once, and its
    `round` to the round that forward ran in (`chunk`: the prompt tokens a round feeds at most).

    Raises:
        ValueError: `slots` is below 1.
    """
    if slots < 1:
        raise ValueError(f"--parallel must be at least 1, got {slots}")
    forwards = _forwards(trace)
    first = {r: int(min(rows.min() for rows in f)) for r, f in forwards.items()}
    waiting = deque(sorted(forwards, key=first.__getitem__))
    running: list[list[int]] = []  # [request, its next forward], in the order they started
    step = np.empty(len(trace), dtype=np.int64)
    rounds = np.empty(len(trace), dtype=np.int64)
    n = k = 0
    while waiting or running:
        while waiting and len(running) < slots:
            running.append([waiting.popleft(), 0])
        decoding = [r for r in running if trace.phase[forwards[r[0]][r[1]][0]] == DECODE]
        for r in decoding:
            rows = forwards[r[0]][r[1]]
            step[rows], rounds[rows] = n, k
            r[1] += 1
        n += bool(decoding)
        budget = chunk
        for i, r in enumerate(r for r in running if all(r is not d for d in decoding)):
            rows = forwards[r[0]][r[1]]
            tokens = len(np.unique(trace.token[rows]))
            if i and tokens > budget:  # the longest waiting always; the others as the budget holds
                continue
            budget -= tokens
            step[rows], rounds[rows] = n, k
            r[1] += 1
            n += 1
        k += 1
        running = [r for r in running if r[1] < len(forwards[r[0]])]
    return dataclasses.replace(trace, step=step, round=rounds)

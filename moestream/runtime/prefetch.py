"""When the runtime reads the next layer's experts ahead (the stale-gate prefetch): plain Python.

A prefetch pays when it reads, in time the disk would otherwise idle, experts the next layer then uses.
So the runtime prefetches (`on`: the first two rules; `auto`: all four):
  * only confident guesses. How often a guess is right depends on its softmax score, and how depends on
    the model (on the trained fixture, 90-99% of the guesses scored 4x a uniform router's or more are
    used, 13-17% of those below 1.3x; a random-weight checkpoint's top-k guesses are right ~100% of the
    time though scored under 2x), so it is measured as the model runs: every guess is checked against
    the routing its layer then gets, its hit counted in its score class (multiples of the uniform score
    1/E: below 1, 1-2, 2-4, 4-8, 8 and more); guesses of a class whose measured precision is
    `PRECISION_MIN` or more are read ahead;
  * never by evicting an expert the current layer or another guess needs, and behind the current
    layer's demand reads in the queue (`ExpertCache.prefetch`);
  * not while the read queue already holds a layer's worth of reads (`queue_full_bytes`): the disk is
    busy, and a prefetch would only push back the next layer's demand reads;
  * only while the disk has idle time to fill: every `PROBE_EVERY` tokens, one token runs without
    prefetch and the disk's idle share over it is measured (`Reader.idle_seconds`); prefetch stays on
    until the next probe if the disk idled at least `IDLE_MIN` of that token, else off (a disk that
    never idles cannot be helped, only crowded by wrong guesses).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

PRECISION_MIN = 0.8
CLASSES = 5  # score classes: [0, 1), [1, 2), [2, 4), [4, 8), [8, inf) x the uniform score
PRIOR = (1.0, 2.0)  # (hits, guesses) every class starts with: 50%, not confident until measured
IDLE_MIN = 0.05
PROBE_EVERY = 8
MODES = ("off", "on", "auto")

Guess = list[tuple[int, float]]  # one token's guessed experts and their softmax scores, best first


class DiskClock(Protocol):
    """What the gate reads from the reader."""

    def idle_seconds(self) -> float: ...

    def pending_bytes(self) -> int: ...


def score_class(score: float, n_experts: int) -> int:
    """0 below the uniform score 1/E, then one class per doubling, the last open-ended."""
    ratio = score * n_experts
    return 0 if ratio < 1 else min(CLASSES - 1, 1 + int(math.log2(ratio)))


class PrefetchGate:
    """Decides which stale-gate guesses are read ahead, and whether now; learns how good they are."""

    def __init__(
        self,
        mode: str,
        disk: DiskClock,
        layers_per_token: int,
        queue_full_bytes: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if mode not in ("on", "auto"):
            raise ValueError(f"prefetch mode must be on or auto here, got {mode!r}")
        self.mode, self.disk, self.clock = mode, disk, clock
        self.layers, self.queue_full_bytes = max(1, layers_per_token), queue_full_bytes
        self.hits = [PRIOR[0]] * CLASSES  # per score class: guesses its layer then used
        self.guesses = [PRIOR[1]] * CLASSES
        self._pending: tuple[int, list[list[tuple[int, int]]]] | None = None  # (layer, per token (e, class))
        self._forwards = 0
        self._probe_start: tuple[float, float] | None = None  # (wall, disk idle) when the probe began
        self.enabled = True  # what the last idle probe decided (auto)
        self.idle_share: float | None = None  # the disk's idle share over the last probe token (auto)
        self.skipped_busy = 0  # forwards whose guess was not read because the queue was full (auto)

    def precision(self, cls: int) -> float:
        """Measured share of a score class's guesses that their layer used."""
        return self.hits[cls] / self.guesses[cls]

    def observe(self, layer: int, rows: Sequence[Sequence[int]]) -> None:
        """`layer`'s actual routing (per token): score the guesses made for it by the previous forward."""
        pending = self._pending
        if pending is None or pending[0] != layer:
            return  # no guess for this layer (or it is this forward's own, for the next layer)
        self._pending = None
        if len(pending[1]) < len(rows):
            return
        # fewer rows than guesses: the forward's last positions (the ggml graphs route only the last one
        # past the last layer's attention), scored against their own guesses
        for guess, row in zip(pending[1][len(pending[1]) - len(rows) :], rows):
            used = set(row)
            for expert, cls in guess:
                self.guesses[cls] += 1
                self.hits[cls] += expert in used

    def choose(self, layer: int, n_experts: int, guesses: Sequence[Guess]) -> list[int]:
        """Remember the guesses for `layer` (to be scored by `observe`); return the confident ones, the
        distinct experts in execution order."""
        classed = [[(e, score_class(s, n_experts)) for e, s in guess] for guess in guesses]
        self._pending = (layer, classed)
        confident = [self.precision(c) >= PRECISION_MIN for c in range(CLASSES)]
        out: dict[int, None] = {}
        for guess in classed:
            for expert, cls in guess:
                if confident[cls]:
                    out.setdefault(expert, None)
        return list(out)

    def allow(self) -> bool:
        """Called once per layer forward (every MoE layer, guess or not): read this one's guess ahead now?"""
        token, layer = divmod(self._forwards, self.layers)
        self._forwards += 1
        if self.mode == "on":
            return True
        probing = token % PROBE_EVERY == 0
        if probing and layer == 0:
            self._probe_start = (self.clock(), self.disk.idle_seconds())
        elif not probing and layer == 0 and self._probe_start is not None:
            self._decide()
        if probing or not self.enabled:
            return False
        if self.disk.pending_bytes() >= self.queue_full_bytes:
            self.skipped_busy += 1
            return False
        return True

    def _decide(self) -> None:
        wall, idle = self._probe_start
        self._probe_start = None
        elapsed = self.clock() - wall
        self.idle_share = (self.disk.idle_seconds() - idle) / elapsed if elapsed > 0 else 0.0
        self.enabled = self.idle_share >= IDLE_MIN

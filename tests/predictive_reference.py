"""The predictive policy as it was before issue 25 made it fast, kept verbatim (less the module docstring,
see `moestream.cache.predictive`) as the oracle of its decisions: the new one must evict the same keys.

This module holds no tests.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar

import numpy as np

from moestream.cache.policy import EvictionPolicy, Key

FAST, SLOW = 0.7, 0.95  # per-visit decay of the two averages
FORECAST_SHARE = 0.5  # weight of the transition table's forecast in q
RANK_WEIGHT = 0.5  # the last of a token's experts counts 1 - RANK_WEIGHT of a use, the first 1
PRIOR = 0.125  # pseudo-count of every transition (and 1 of every visit)
DUEL_DECAY = 0.999  # per forward: the ghosts' misses are compared over the last ~1000 forwards
DUEL_MARGIN = 0.05  # the other ghost must miss this much less than the leader to take over
PREDICTIVE, LFU, LRU = 0, 1, 2  # the rankings (ghost and leader numbers)
REAL = 3  # the real cache's row in the touch clocks


class ReferencePredictivePolicy(EvictionPolicy):
    """Evicts the key least likely to be used soon, by learned per-key averages and a per-layer transition
    table, or as LFU or LRU while their ghost caches miss less. See the module docstring."""

    name: ClassVar[str] = "predictive"

    def __init__(self, layers: Sequence[int], n_experts: int) -> None:
        """`layers`: the MoE layers in the order a token visits them; `n_experts` per layer."""
        self.layers, self.n_experts = list(layers), n_experts
        self._pos = {layer: i for i, layer in enumerate(self.layers)}
        n_layers, n_keys = len(self.layers), len(self.layers) * n_experts
        self._fast = np.zeros(n_keys)
        self._slow = np.zeros(n_keys)
        self._forecast = np.zeros(n_keys)  # the transition table's forecast for the key's next visit
        # transition counts between consecutive visits of a layer: follows[from, to], and visits after `from`
        self._follows = np.zeros((n_layers, n_experts, n_experts), dtype=np.int32)
        self._after = np.zeros((n_layers, n_experts), dtype=np.int64)
        self._previous: list[np.ndarray | None] = [None] * n_layers
        self._uses = np.zeros(n_keys)  # forwards that used the key (LFU's count)
        self._last_use = np.zeros(n_keys)  # number of the last forward that used the key
        # LRU orders by, and LFU breaks ties by, the order of the last touch, a forward's hits before its
        # misses (as `LRUPolicy`, `LFUPolicy`), which differs between caches: a row per ghost, one for the
        # real cache
        self._touched = np.zeros((4, n_keys))
        self._clock = 0
        self._forward = 0
        self._layer = 0  # position of the current forward's layer
        self._capacity = 0
        self._resident = np.zeros(n_keys, dtype=bool)
        self._ghosts = np.zeros((3, n_keys), dtype=bool)  # ghost caches run by one ranking each
        self._ghost_misses = [0.0, 0.0, 0.0]  # exponentially weighted, per ghost
        self.leader = LFU  # whose ranking the real cache's evictions follow
        self._order: list[int] | None = None  # the forward's first victims, taken at its first eviction
        self._cursor = 0  # `_order[:_cursor]` are evicted already
        self._chunk = 1  # how many victims `_order` holds: the forward's misses plus its own keys

    def bind(self, capacity: int) -> None:
        self._capacity = capacity

    def index(self, key: Key) -> int:
        """The dense index of a (layer, expert) key."""
        layer, expert = key  # type: ignore[misc]
        pos = self._pos.get(layer)
        if pos is None or not 0 <= expert < self.n_experts:
            raise KeyError(f"{key!r} is not a key of layers {self.layers} x {self.n_experts} experts")
        return pos * self.n_experts + expert

    def _key(self, i: int) -> Key:
        return (self.layers[i // self.n_experts], i % self.n_experts)

    # --- learning ---------------------------------------------------------------------------------

    def on_group(self, keys: Sequence[Key], uses: Sequence[int] | None = None, tokens: int = 1) -> None:
        if not self._capacity:
            raise RuntimeError("PredictivePolicy needs its capacity: use it inside a ResidentSet")
        idx = np.fromiter((self.index(k) for k in keys), dtype=np.int64, count=len(keys))
        if len(idx) == 0:
            return
        self._forward += 1
        self._layer = int(idx[0]) // self.n_experts
        self._learn(idx, uses, tokens)
        self._duel(idx)
        self._touch(REAL, idx, self._resident[idx])
        self._order, self._chunk = None, len(idx) + int((~self._resident[idx]).sum())

    def _touch(self, cache: int, idx: np.ndarray, hit: np.ndarray) -> None:
        """Stamp the forward's keys in `cache`'s touch order: its hits first, then its misses."""
        order = np.concatenate([idx[hit], idx[~hit]])
        self._touched[cache][order] = self._clock + np.arange(1, len(order) + 1)
        self._clock += len(order)

    def _learn(self, idx: np.ndarray, uses: Sequence[int] | None, tokens: int) -> None:
        """Decay and update the averages of this layer's keys, and the transition table, with one forward."""
        n, pos = self.n_experts, self._layer
        span = slice(pos * n, (pos + 1) * n)
        experts = idx - pos * n
        used = np.zeros(n)
        if tokens > 1 and uses is not None:  # several tokens at once: per-token rates, as `tokens` visits
            used[experts] = np.asarray(uses, dtype=float) / tokens
        else:  # one token: `idx` is in router order
            tokens = 1
            used[experts] = 1.0 - RANK_WEIGHT * np.arange(len(idx)) / max(1, len(idx) - 1)
        for avg, decay in ((self._fast, FAST), (self._slow, SLOW)):
            keep = decay**tokens
            avg[span] = keep * avg[span] + (1.0 - keep) * used
        previous = self._previous[pos]
        if previous is not None:
            self._follows[pos][np.ix_(previous, experts)] += 1
            self._after[pos][previous] += 1
        self._previous[pos] = experts
        # forecast[e] = sum over this visit's experts a of (follows[a, e] + 1/8) / (after[a] + 1): a prior of
        # 1/8 per pair so that an unseen pair is neither certain nor impossible
        counts = self._follows[pos][experts].sum(axis=0, dtype=np.int64)
        self._forecast[span] = (counts + PRIOR * len(experts)) / (
            self._after[pos][experts].sum() + len(experts)
        )
        self._uses[idx] += 1.0
        self._last_use[idx] = self._forward

    def keep_values(self, keys: np.ndarray) -> np.ndarray:
        """Keep value of the keys at these dense indices, at the current forward (higher stays longer)."""
        n_layers = len(self.layers)
        distance = (keys // self.n_experts - self._layer) % n_layers
        distance = np.where(distance == 0, n_layers, distance).astype(float)
        p = 0.5 * (self._fast[keys] + self._slow[keys])
        q = FORECAST_SHARE * self._forecast[keys] + (1.0 - FORECAST_SHARE) * p
        return q / distance

    def _ranking(
        self, by: int, candidates: np.ndarray, first: int | None = None, cache: int = REAL
    ) -> np.ndarray:
        """Key indices of `candidates` (a mask) in the eviction order of ranking `by`: lowest keep value
        (PREDICTIVE; ties: least recently used, then lowest index), fewest uses (LFU; ties: least recently
        touched in `cache`) or least recently touched in `cache` (LRU); only the `first` ones when given
        (a partition, then a sort of those)."""
        keys = np.flatnonzero(candidates)
        touched = self._touched[cache][keys]
        value = (
            {PREDICTIVE: self.keep_values, LFU: self._uses.__getitem__}[by](keys) if by != LRU else touched
        )
        if first is not None and first < len(keys):
            near = value <= np.partition(value, first - 1)[first - 1]  # ties at the cut stay in
            keys, value, touched = keys[near], value[near], touched[near]
        if by == PREDICTIVE:
            order = keys[np.lexsort((keys, self._last_use[keys], value))]
        else:
            order = keys[np.lexsort((touched, value))]
        return order if first is None else order[:first]

    def _duel(self, idx: np.ndarray) -> None:
        """Replay this forward in both ghost caches; the real cache follows the one that misses less."""
        for by, ghost in enumerate(self._ghosts):
            hit = ghost[idx]
            missed = idx[~hit]
            overflow = int(ghost.sum()) + len(missed) - self._capacity
            if overflow > 0:  # victims outside the forward's own keys, as the real cache takes them
                others = ghost.copy()
                others[idx] = False
                victims = self._ranking(by, others, overflow, cache=by)
                ghost[victims] = False
                overflow -= len(victims)
            ghost[missed[max(0, overflow) :]] = True  # a forward larger than the cache keeps its last keys
            self._ghost_misses[by] = self._ghost_misses[by] * DUEL_DECAY + len(missed)
            if by != PREDICTIVE:
                self._touch(by, idx, hit)
        misses = self._ghost_misses
        best = min(range(len(misses)), key=misses.__getitem__)  # the first of equals: PREDICTIVE, LFU, LRU
        if misses[best] < (1.0 - DUEL_MARGIN) * misses[self.leader]:
            self.leader = best

    # --- the real cache -----------------------------------------------------------------------------

    def on_hit(self, key: Key) -> None:
        pass  # everything a hit tells was learned from the forward (`on_group`)

    def on_admit(self, key: Key) -> None:
        self._resident[self.index(key)] = True

    def on_evict(self, key: Key) -> None:
        self._resident[self.index(key)] = False

    def ranked(self) -> Iterator[Key]:
        resident = self._resident
        if self._order is None:  # at the forward's first eviction: enough victims for all its misses
            self._order, self._cursor = self._ranking(self.leader, resident, self._chunk).tolist(), 0
        order = self._order
        while self._cursor < len(order) and not resident[order[self._cursor]]:  # evicted: skip for good
            self._cursor += 1
        for i in order[self._cursor :]:
            if resident[i]:
                yield self._key(i)
        rest = resident.copy()  # rarely reached: every key of the first batch was protected
        rest[order] = False
        for i in self._ranking(self.leader, rest).tolist():
            yield self._key(i)

    def victim(self) -> Key:
        return next(self.ranked())

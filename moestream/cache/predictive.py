"""A predictive eviction policy: it estimates when each expert is used next from the routing so far.

Plain Python over numpy (no torch), shared by the engine's cache and the trace simulator like every
policy in `moestream.cache.policy`. What it knows about the workload, all measured on learned routing
(the trained fixture and the real traces; docs/traces.md):

- Decode visits the MoE layers in a cycle, one forward per layer per token. An expert of layer l can
  only be used again when layer l runs again, so what matters is the chance that it is used at its
  layer's next visits and how far away that visit is.
- An expert a token just used is about 3x more likely than another to be used by the next token (0.32
  against 0.10 on the fixture), the more so the higher the router ranked it (0.45 for the first, 0.24
  for the eighth), and which experts follow which is partly predictable (a per-layer transition table).
- But stationary routing (random-weight checkpoints) is served best by plain frequency (LFU), very
  sticky routing by recency (LRU), and the phase of the layer cycle only misleads there.

So it keeps, per key, a fast and a slow exponential average of "used at its layer's visit" (router rank
weighted), and per layer a table of which expert follows which between consecutive visits. A key's keep
value is `q / d`: `q` the mean of the two averages' mean and the table's forecast for the next visit,
`d` the forwards until its layer's next visit (1 for the next layer, L for the current one); the lowest
value leaves first (ties: the least recently used, then the lowest layer and expert). Three ghost
caches of the same capacity replay the same accesses, each evicting by one ranking: this one, LFU's
(fewest uses since the start) and LRU's. The real cache's evictions follow one of the three, LFU's at
first; another takes over once its ghost has missed 5% less than the leader's over the last ~1000
forwards (exponentially weighted), so the policy falls back to LFU or LRU where they win.

Protocol: the policy must hear of each layer forward before its hits and misses, through
`ResidentSet.begin_group(keys, uses, tokens)` (`access_group` calls it): `keys` in execution order (for
one token, router order), `uses[i]` the number of the forward's `tokens` routed to `keys[i]`.

Cost: what is learned does not depend on the capacity, so it lives in `RoutingStats`
(`moestream.cache.routing_stats`), which the caches of several capacities replaying the same forwards
(the simulator's budgets) share, learning each forward once. Per cache, the ghosts
(`moestream.cache.ghosts`) and the real cache keep the LRU and LFU orders incrementally (an ordered dict,
heaps), and the predictive order is computed when a victim is needed, over the cache's own keys only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import ClassVar

import numpy as np

from moestream.cache.ghosts import KeySet, LFUGhost, LRUGhost, PredictiveGhost, RisingHeap
from moestream.cache.policy import EvictionPolicy, Key, Priority
from moestream.cache.routing_stats import FAST, FORECAST_SHARE, PRIOR, RANK_WEIGHT, SLOW, RoutingStats

__all__ = ["FAST", "FORECAST_SHARE", "PRIOR", "RANK_WEIGHT", "SLOW", "PredictivePolicy", "RoutingStats"]

DUEL_DECAY = 0.999  # per forward: the ghosts' misses are compared over the last ~1000 forwards
DUEL_MARGIN = 0.05  # the other ghost must miss this much less than the leader to take over
PREDICTIVE, LFU, LRU = 0, 1, 2  # the rankings (ghost and leader numbers)


class PredictivePolicy(EvictionPolicy):
    """Evicts the key least likely to be used soon, by learned per-key averages and a per-layer transition
    table, or as LFU or LRU while their ghost caches miss less. See the module docstring."""

    name: ClassVar[str] = "predictive"

    def __init__(self, layers: Sequence[int], n_experts: int, stats: RoutingStats | None = None) -> None:
        """`layers`: the MoE layers in the order a token visits them; `n_experts` per layer. `stats`: what
        is learned, shared with other policies that see the same forwards (a new one when None)."""
        self.stats = stats if stats is not None else RoutingStats(layers, n_experts)
        if self.stats.layers != list(layers) or self.stats.n_experts != n_experts:
            raise ValueError("the shared RoutingStats were made for other layers or another expert count")
        self.layers, self.n_experts = list(layers), n_experts
        n_keys = len(self.stats.keys)
        self._forward = 0  # forwards this policy has seen
        self._capacity = 0
        self._ghosts: list[LRUGhost | LFUGhost | PredictiveGhost] = []  # by ranking, made at `bind`
        self._ghost_misses = [0.0, 0.0, 0.0]  # exponentially weighted, per ghost
        self._resident = KeySet(0)  # the real cache's keys, made at `bind`
        # the real cache's touch order (0: never): LRU orders by it, LFU breaks ties by it
        self._touched = [0] * n_keys
        self._clock = 0
        self._leader = LFU  # whose ranking the real cache's evictions follow
        self._heap: RisingHeap | None = None  # residents in the LFU or LRU leader's order, once asked
        self._order: list[int] | None = None  # the forward's first victims, taken at its first eviction
        self._cursor = 0  # `_order[:_cursor]` are evicted already
        self._chunk = 1  # how many victims `_order` holds: the forward's misses plus its own keys

    @property
    def leader(self) -> int:
        """Whose ranking the real cache's evictions follow: PREDICTIVE, LFU or LRU."""
        return self._leader

    @leader.setter
    def leader(self, ranking: int) -> None:
        self._leader, self._heap = ranking, None  # the new leader's heap is built when first needed

    def bind(self, capacity: int) -> None:
        self._capacity = capacity
        n_keys = len(self.stats.keys)
        self._ghosts = [PredictiveGhost(capacity, n_keys), LFUGhost(capacity, self.stats), LRUGhost(capacity)]
        self._resident = KeySet(min(capacity, n_keys))

    def index(self, key: Key) -> int:
        """The dense index of a (layer, expert) key."""
        return self.stats.index(key)

    def keep_values(self, keys: np.ndarray) -> np.ndarray:
        """Keep value of the keys at these dense indices, at the current forward (higher stays longer)."""
        return self.stats.keep_values(keys)

    # --- learning and the duel ----------------------------------------------------------------------

    def on_group(self, keys: Sequence[Key], uses: Sequence[int] | None = None, tokens: int = 1) -> None:
        if not self._capacity:
            raise RuntimeError("PredictivePolicy needs its capacity: use it inside a ResidentSet")
        if len(keys) == 0:
            return
        idx = self.stats.follow(self._forward + 1, keys, uses, tokens)
        self._forward += 1
        self._duel(idx)
        resident, touched = self._resident.where, self._touched
        hits = [i for i in idx if i in resident]
        misses = [i for i in idx if i not in resident]
        for i in hits + misses:  # the real cache's touch order: hits first, as the ghosts'
            self._clock += 1
            touched[i] = self._clock
        # the hits' places in the LFU or LRU order only rose: `_heap` finds out when they reach its top
        self._order, self._chunk = None, len(idx) + len(misses)

    def _duel(self, idx: list[int]) -> None:
        """Replay this forward in the ghost caches; the real cache follows the one that misses less."""
        misses, forward = self._ghost_misses, self.stats.idx_set
        for by, ghost in enumerate(self._ghosts):
            misses[by] = misses[by] * DUEL_DECAY + ghost.access(idx, forward, self.stats)
        best = min(range(len(misses)), key=misses.__getitem__)  # the first of equals: PREDICTIVE, LFU, LRU
        if misses[best] < (1.0 - DUEL_MARGIN) * misses[self._leader]:
            self.leader = best

    # --- the real cache -----------------------------------------------------------------------------

    def _priority(self, i: int) -> Priority:
        """Key `i`'s place in the LFU or LRU leader's order (lowest leaves first; ties: lowest index)."""
        if self._leader == LFU:
            return (self.stats.uses[i], self._touched[i], i)
        return (self._touched[i], i)

    def on_hit(self, key: Key) -> None:
        pass  # everything a hit tells was learned from the forward (`on_group`)

    def on_admit(self, key: Key) -> None:
        i = self.stats.index(key)
        self._resident.add(i)
        if self._heap is not None:
            self._heap.push(i)

    def on_evict(self, key: Key) -> None:
        i = self.stats.index(key)
        self._resident.remove(i)
        if self._heap is not None:
            self._heap.drop(i)

    def _ranking(self, first: int, outside: Collection[int] = ()) -> list[int]:
        """The `first` residents in the leader's eviction order, leaving out those in `outside`."""
        if self._leader == PREDICTIVE:
            keys = self._resident.array()
            if outside:
                keys = keys[~np.isin(keys, list(outside))]
            return self.stats.lowest(keys, first)
        if self._heap is None:
            self._heap = RisingHeap(self._priority)
            for i in self._resident.array().tolist():
                self._heap.push(i)
        return self._heap.smallest(first, outside)

    def ranked(self) -> Iterator[Key]:
        resident, keys = self._resident.where, self.stats.keys
        if self._order is None:  # at the forward's first eviction: enough victims for all its misses
            self._order, self._cursor = self._ranking(self._chunk), 0
        order = self._order
        while self._cursor < len(order) and order[self._cursor] not in resident:  # evicted: skip for good
            self._cursor += 1
        for i in order[self._cursor :]:
            if i in resident:
                yield keys[i]
        # past the first batch (every key of it protected, or evicted by a prefetch): the residents outside
        # it, in order, as the caller asks for them: a few at first, then four times as many each time
        outside, first, given = set(order), 1, 0
        while True:
            batch = self._ranking(first, outside)
            for i in batch[given:]:
                yield keys[i]
            if len(batch) < first:
                return
            given, first = len(batch), 4 * first

    def victim(self) -> Key:
        return next(self.ranked())

"""What the predictive policy learns from routing (`moestream.cache.predictive`): per key a fast and a
slow average of "used at its layer's visit", a per-layer table of which expert follows which, uses and
last use, and from them the keep value. None of it depends on the cache's capacity, so the caches of one
simulation (one per budget) share one `RoutingStats` and learn each forward once.

Plain Python over numpy (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moestream.cache.policy import Key

FAST, SLOW = 0.7, 0.95  # per-visit decay of the two averages
FORECAST_SHARE = 0.5  # weight of the transition table's forecast in q
RANK_WEIGHT = 0.5  # the last of a token's experts counts 1 - RANK_WEIGHT of a use, the first 1
PRIOR = 0.125  # pseudo-count of every transition (and 1 of every visit)


class RoutingStats:
    """What the policy learns from the forwards it sees, the same at every capacity: the two averages and
    the transition table per key, uses and last use, and from them each key's keep value. Keys are dense
    indices (`index`). Several policies may share one (`PredictivePolicy(..., stats=)`) if they see the
    same forwards in the same order: the first to see a forward teaches it, the others check it is the same.
    """

    def __init__(self, layers: Sequence[int], n_experts: int) -> None:
        """`layers`: the MoE layers in the order a token visits them; `n_experts` per layer."""
        self.layers, self.n_experts = list(layers), n_experts
        n_layers = len(self.layers)
        self.keys = [(layer, e) for layer in self.layers for e in range(n_experts)]  # dense index -> key
        self._index = {key: i for i, key in enumerate(self.keys)}
        n_keys = len(self.keys)
        self._fast, self._slow = np.zeros(n_keys), np.zeros(n_keys)
        self._forecast = np.zeros(n_keys)  # the transition table's forecast for the key's next visit
        self._q = np.zeros(n_keys)  # the keep value's numerator, refreshed with its layer's averages
        # transition counts between consecutive visits of a layer: follows[from, to], and visits after `from`
        self._follows = np.zeros((n_layers, n_experts, n_experts), dtype=np.int32)
        self._after = np.zeros((n_layers, n_experts), dtype=np.int64)
        self._previous: list[np.ndarray | None] = [None] * n_layers
        self.uses = [0] * n_keys  # forwards that used the key (LFU's count)
        self.last_use = np.zeros(n_keys)  # number of the last forward that used the key
        self._key_layer = np.arange(n_keys) // n_experts  # position of each key's layer
        self.forward = 0  # forwards learned
        self.layer = 0  # position of the current forward's layer
        self.idx: list[int] = []  # the current forward's keys, dense, in execution order
        self.idx_set: frozenset[int] = frozenset()
        self._keys: Sequence[Key] | None = None  # the object the current forward's keys came in
        self._values: np.ndarray | None = None  # every key's keep value at this forward, once asked for
        self._values_outside = self._q  # the same with the forward's own keys at +inf

    def index(self, key: Key) -> int:
        """The dense index of a (layer, expert) key."""
        i = self._index.get(key)
        if i is None:
            raise KeyError(f"{key!r} is not a key of layers {self.layers} x {self.n_experts} experts")
        return i

    def follow(self, forward: int, keys: Sequence[Key], uses: Sequence[int] | None, tokens: int) -> list[int]:
        """A policy's `forward`-th forward (from 1): learn it if it is new, else check it is the one learned.
        Returns its dense keys."""
        if forward == self.forward and keys is self._keys:  # a sibling handed the very same forward
            return self.idx
        idx = [self.index(key) for key in keys]
        if forward == self.forward + 1:
            self._learn(idx, uses, tokens)
            self._keys = keys
        elif forward != self.forward or idx != self.idx:
            raise RuntimeError(
                f"policies sharing RoutingStats must see the same forwards in order: forward {forward} "
                f"with keys {list(keys)[:4]}..., but forward {self.forward} was learned"
            )
        return self.idx

    def _learn(self, keys: list[int], uses: Sequence[int] | None, tokens: int) -> None:
        """Decay and update the averages of this layer's keys, and the transition table, with one forward."""
        self.forward += 1
        self.idx, self.idx_set, self._values = keys, frozenset(keys), None
        idx = np.array(keys, dtype=np.int64)
        n = self.n_experts
        pos = self.layer = keys[0] // n
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
        # q: the mean of the averages' mean and the forecast (the same operations, element by element, as
        # computing it when asked: a layer's inputs change only here)
        p = 0.5 * (self._fast[span] + self._slow[span])
        self._q[span] = FORECAST_SHARE * self._forecast[span] + (1.0 - FORECAST_SHARE) * p
        for i in keys:
            self.uses[i] += 1
        self.last_use[idx] = self.forward

    def keep_values(self, keys: np.ndarray) -> np.ndarray:
        """Keep value of the keys at these dense indices, at the current forward (higher stays longer):
        q over the forwards until the key's layer comes back."""
        return self._q[keys] / self._distance(self._key_layer[keys])

    def _distance(self, layer: np.ndarray) -> np.ndarray:
        """Forwards until these layer positions come back (the current one: a whole cycle), as floats."""
        n_layers = len(self.layers)
        distance = (layer - self.layer) % n_layers
        return np.where(distance == 0, n_layers, distance).astype(float)

    def lowest(
        self, keys: np.ndarray, first: int | None = None, *, outside_forward: bool = False
    ) -> list[int]:
        """`keys` (dense) by keep value, lowest first (ties: the least recently used, then the lowest
        index); only the `first` ones when given (a partition, then a sort of those). `outside_forward`:
        leave out the current forward's keys (`first` must not exceed the keys left)."""
        if self._values is None:  # once per forward, for every cache that shares these stats
            self._values = self._q / self._distance(self._key_layer)
            self._values_outside = self._values.copy()
            self._values_outside[self.idx] = np.inf  # keep values are finite: these sort last
        value = (self._values_outside if outside_forward else self._values)[keys]
        if first is not None and 2 * first < len(keys):  # else sorting them all is as cheap
            keys, value = self._cut(keys, value, first)
        order = keys[np.lexsort((keys, self.last_use[keys], value))]
        return (order if first is None else order[:first]).tolist()

    def _cut(self, keys: np.ndarray, value: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
        """A subset of `keys` (with their values) that holds the `first` lowest in `lowest`'s order."""
        low = value.min()
        tied = value == low
        if np.count_nonzero(tied) < first:  # ties at the cut stay in, the sort after takes them apart
            near = value <= np.partition(value, first - 1)[first - 1]
            return keys[near], value[near]
        # at least `first` keys share the lowest value (experts never used do, often by the hundred, and
        # numpy's partition is slow on such ties): the least recently used of them, then the lowest,
        # last use and index taken as one integer
        keys = keys[tied]
        rank = self.last_use[keys].astype(np.int64) * len(self.keys) + keys
        keys = keys[np.argpartition(rank, first - 1)[:first]]
        return keys, np.full(first, low)

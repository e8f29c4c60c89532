"""The predictive eviction policy against a line-by-line transcription of its definition in plain Python
(no numpy), against LFU and LRU when it follows them, and on routing where it must win."""

from __future__ import annotations

import random

import pytest

import moestream.cache.predictive as P
from moestream.cache.policy import LFUPolicy, LRUPolicy, ResidentSet
from moestream.cache.predictive import PredictivePolicy


class Transcription:
    """The module docstring of `moestream.cache.predictive`, written out with dicts, lists and sorted()."""

    def __init__(self, layers: list[int], n_experts: int, capacity: int) -> None:
        self.layers, self.n, self.cap = layers, n_experts, capacity
        keys = len(layers) * n_experts
        self.fast, self.slow, self.forecast = [0.0] * keys, [0.0] * keys, [0.0] * keys
        self.uses, self.last_use = [0] * keys, [0] * keys
        self.touched = [[0] * keys for _ in range(4)]  # ghosts 0-2, real cache 3
        self.follows = [[[0] * n_experts for _ in range(n_experts)] for _ in layers]
        self.after = [[0] * n_experts for _ in layers]
        self.previous: list[list[int] | None] = [None] * len(layers)
        self.ghosts: list[set[int]] = [set(), set(), set()]
        self.ghost_misses = [0.0, 0.0, 0.0]
        self.leader, self.resident, self.forward, self.pos, self.clock = 1, set(), 0, 0, 0
        self.leaders: list[int] = []

    def keep(self, i: int) -> float:
        n_layers = len(self.layers)
        d = (i // self.n - self.pos) % n_layers or n_layers
        p = 0.5 * (self.fast[i] + self.slow[i])
        q = P.FORECAST_SHARE * self.forecast[i] + (1.0 - P.FORECAST_SHARE) * p
        return q / d

    def rank(self, by: int, cache: int):
        if by == 0:
            return lambda i: (self.keep(i), self.last_use[i], i)
        if by == 1:
            return lambda i: (self.uses[i], self.touched[cache][i])
        return lambda i: self.touched[cache][i]

    def touch(self, cache: int, idx: list[int], present: set[int]) -> None:
        for i in [i for i in idx if i in present] + [i for i in idx if i not in present]:
            self.clock += 1
            self.touched[cache][i] = self.clock

    def learn(self, idx: list[int], uses: list[int] | None, tokens: int) -> None:
        n, pos = self.n, self.pos
        experts = [i - pos * n for i in idx]
        used = [0.0] * n
        if tokens > 1 and uses is not None:
            for e, u in zip(experts, uses):
                used[e] = u / tokens
        else:
            tokens = 1
            for r, e in enumerate(experts):
                used[e] = 1.0 - P.RANK_WEIGHT * r / max(1, len(experts) - 1)
        for avg, decay in ((self.fast, P.FAST), (self.slow, P.SLOW)):
            keep = decay**tokens
            for e in range(n):
                avg[pos * n + e] = keep * avg[pos * n + e] + (1.0 - keep) * used[e]
        if self.previous[pos] is not None:
            for a in self.previous[pos]:
                self.after[pos][a] += 1
                for b in experts:
                    self.follows[pos][a][b] += 1
        self.previous[pos] = experts
        after = sum(self.after[pos][a] for a in experts)
        for e in range(n):
            count = sum(self.follows[pos][a][e] for a in experts)
            self.forecast[pos * n + e] = (count + P.PRIOR * len(experts)) / (after + len(experts))
        for i in idx:
            self.uses[i] += 1
            self.last_use[i] = self.forward

    def duel(self, idx: list[int]) -> None:
        for by, ghost in enumerate(self.ghosts):
            present = set(ghost)
            missed = [i for i in idx if i not in ghost]
            overflow = len(ghost) + len(missed) - self.cap
            if overflow > 0:
                victims = sorted(ghost - set(idx), key=self.rank(by, by))[:overflow]
                ghost.difference_update(victims)
                overflow -= len(victims)
            ghost.update(missed[max(0, overflow) :])
            self.ghost_misses[by] = self.ghost_misses[by] * P.DUEL_DECAY + len(missed)
            if by:
                self.touch(by, idx, present)
        best = min(range(3), key=lambda g: self.ghost_misses[g])
        if self.ghost_misses[best] < (1.0 - P.DUEL_MARGIN) * self.ghost_misses[self.leader]:
            self.leader = best

    def group(
        self, keys: list[tuple[int, int]], uses: list[int] | None, tokens: int
    ) -> list[tuple[int, int]]:
        idx = [self.layers.index(layer) * self.n + e for layer, e in keys]
        self.forward += 1
        self.pos = idx[0] // self.n
        self.learn(idx, uses, tokens)
        self.duel(idx)
        self.touch(3, idx, self.resident)
        self.leaders.append(self.leader)
        misses = []
        for i, key in zip(idx, keys):
            if i in self.resident:
                continue
            misses.append(key)
            if len(self.resident) >= self.cap:
                self.resident.remove(min(self.resident - set(idx), key=self.rank(self.leader, 3)))
            self.resident.add(i)
        return misses


def forwards(seed: int, layers: list[int], n_experts: int, k: int, tokens: int = 240):
    """Requests of a 3-token prefill then decode, cycling over `layers`; each request and layer favours a
    few experts that drift, so recency, frequency and transitions all matter. Yields (keys, uses, tokens)."""
    rng = random.Random(seed)
    favour = {layer: rng.sample(range(n_experts), k + 1) for layer in layers}
    for t in range(tokens):
        if t % 40 == 0:  # a new request: a prefill forward of 3 tokens per layer
            for layer in layers:
                rows = [rng.sample(range(n_experts), k) for _ in range(3)]
                seen: dict[int, int] = {}
                for row in rows:
                    for e in row:
                        seen[e] = seen.get(e, 0) + 1
                yield [(layer, e) for e in seen], list(seen.values()), 3
            continue
        for layer in layers:
            if rng.random() < 0.1:
                favour[layer][rng.randrange(k + 1)] = rng.randrange(n_experts)
            row: list[int] = []
            while len(row) < k:
                e = rng.choice(favour[layer]) if rng.random() < 0.7 else rng.randrange(n_experts)
                if e not in row:
                    row.append(e)
            yield [(layer, e) for e in row], [1] * k, 1


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("capacity", [6, 9, 14])
def test_policy_equals_its_transcription(seed: int, capacity: int) -> None:
    layers, n_experts = [0, 2, 5], 6
    oracle = Transcription(layers, n_experts, capacity)
    cache = ResidentSet(capacity, PredictivePolicy(layers, n_experts))
    for keys, uses, tokens in forwards(seed, layers, n_experts, k=2):
        _, misses = cache.access_group(keys, uses, tokens)
        assert misses == oracle.group(keys, uses, tokens)
        assert cache.policy.leader == oracle.leaders[-1]
        assert {cache.policy.index(k) for k in cache._slot_of} == oracle.resident


def test_the_transcriptions_cover_every_leader() -> None:
    seen = set()
    for seed in range(3):
        for capacity in (6, 9, 14):
            oracle = Transcription([0, 2, 5], 6, capacity)
            for keys, uses, tokens in forwards(seed, [0, 2, 5], 6, k=2):
                oracle.group(keys, uses, tokens)
            seen |= set(oracle.leaders)
    assert seen == {0, 1, 2}  # the equality above was checked under all three rankings


@pytest.mark.parametrize("leader,plain", [(P.LFU, LFUPolicy), (P.LRU, LRUPolicy)])
def test_following_lfu_or_lru_it_decides_as_they_do(leader, plain, monkeypatch) -> None:
    monkeypatch.setattr(P, "DUEL_MARGIN", 1.0)  # no ghost can take over: the first leader stays
    for capacity in (6, 10):
        policy = PredictivePolicy([0, 1, 2, 3], 8)
        policy.leader = leader
        ours, theirs = ResidentSet(capacity, policy), ResidentSet(capacity, plain())
        for keys, uses, tokens in forwards(7, [0, 1, 2, 3], 8, k=3):
            assert ours.access_group(keys, uses, tokens) == theirs.access_group(keys)
        assert policy.leader == leader


def misses(policy_of, capacity: int, layers: list[int], n_experts: int, k: int, seed: int) -> int:
    cache = ResidentSet(capacity, policy_of())
    return sum(len(cache.access_group(*f)[1]) for f in forwards(seed, layers, n_experts, k, tokens=400))


def test_it_beats_lru_and_lfu_where_routing_drifts_and_repeats() -> None:
    """Sticky, drifting routing over a layer cycle larger than the cache: recency alone evicts each expert
    just before its layer comes back, frequency alone keeps stale favourites."""
    layers, n, k = list(range(8)), 16, 2
    for capacity in (12, 24):
        lru = misses(LRUPolicy, capacity, layers, n, k, seed=1)
        lfu = misses(LFUPolicy, capacity, layers, n, k, seed=1)
        ours = misses(lambda: PredictivePolicy(layers, n), capacity, layers, n, k, seed=1)
        assert ours < 0.95 * min(lru, lfu), (capacity, ours, lru, lfu)


def test_user_facing_errors() -> None:
    policy = PredictivePolicy([0, 1], 4)
    with pytest.raises(RuntimeError, match="inside a ResidentSet"):
        policy.on_group([(0, 1)])
    cache = ResidentSet(2, policy)
    with pytest.raises(KeyError, match=r"\(3, 1\) is not a key of layers \[0, 1\] x 4 experts"):
        cache.access_group([(3, 1)])
    with pytest.raises(KeyError, match="not a key"):
        cache.access_group([(0, 4)])

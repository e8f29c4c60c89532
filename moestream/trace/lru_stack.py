"""Every LRU budget in one pass over a replay: stack distances (Mattson et al., 1970), adapted to the way
`ResidentSet.access_group` orders the keys of one layer forward.

Why it holds. Under `LRUPolicy`, the keys resident at capacity C are always the C most recently touched
ones: a forward touches its hits first, so while it admits its misses every key of the forward is newer
than every other resident, and "the least recent key that is not the forward's" (the set's victim) is
simply the least recent key; with none left, the set's fallback victim is the least recent too. Inside
one forward the touch order is its hits in execution order, then its misses in execution order.

So the access of key k at forward t is a hit at capacity C iff fewer than C keys were touched after k's
previous forward t0: D, the distinct keys of the forwards between t0 and t (the same at every capacity),
plus A_C, the keys of t0 still last touched there and placed after k in t0's order. That order depends
on which keys of t0 hit at C, so unlike the textbook case there is no single stack distance (a key can
hit at C and miss at C + 1). But A_C lies in [0, g], g = t0's other keys still last touched there: every
capacity above D + g hits, every one up to D misses, and only the requested capacities in between need
A_C, from the hit sets stored with t0's keys. A hit set is kept as (lo, extra): every capacity index
from `lo` up hits, plus the indices in `extra` (None when empty; all below `lo`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

from moestream.trace.replay import Key, Replay

Cell = tuple[int, int, int]  # hits, misses, bytes read
# the last touch of a key: (forward, position in it, lo, extra) -- see the module docstring
Touch = tuple[int, int, int, frozenset[int] | None]


class Fenwick:
    """Prefix sums over forward indices (a binary indexed tree): how many keys were last touched at or
    before each forward, in O(log n) per update and query."""

    def __init__(self, size: int) -> None:
        self._tree = [0] * (size + 1)

    def add(self, index: int, delta: int) -> None:
        """Add `delta` at `index`."""
        tree, i = self._tree, index + 1
        while i < len(tree):
            tree[i] += delta
            i += i & -i

    def prefix(self, index: int) -> int:
        """The sum over indices 0..index."""
        tree, i, total = self._tree, index + 1, 0
        while i:
            total += tree[i]
            i &= i - 1
        return total


def lru_counts(replay: Replay, capacities: Iterable[int], unit: Sequence[int]) -> dict[int, list[Cell]]:
    """Replay `replay` under LRU at every capacity at once.

    Returns:
        capacity -> (hits, misses, bytes read) per cell (`Replay.cell`), a miss reading `unit[layer]`
        bytes: what `ResidentSet(capacity, LRUPolicy())` driven by `access_group` counts.
    """
    caps = sorted(set(capacities))
    m = len(caps)
    hits = [[0] * (m + 1) for _ in range(4)]  # difference arrays over capacity indices
    hit_bytes = [[0] * (m + 1) for _ in range(4)]
    accesses, access_bytes = [0] * 4, [0] * 4
    last: dict[Key, Touch] = {}
    alive = [0] * len(replay)  # keys whose last touch is at each forward
    tree, seen = Fenwick(len(replay)), 0
    for t, keys in enumerate(replay.keys):
        cell, u = replay.cell[t], unit[replay.layer[t]]
        sets = []
        for key in keys:  # every hit set from the state before the forward: it touches nothing first
            prev = last.get(key)
            if prev is None:
                lo, extra = m, None
            else:
                lo, extra = _hit_set(prev, key, seen - tree.prefix(prev[0]), replay, last, alive, caps)
            _count(hits[cell], hit_bytes[cell], lo, extra, u)
            sets.append((key, prev, lo, extra))
        for pos, (key, prev, lo, extra) in enumerate(sets):
            if prev is None:
                seen += 1
            else:
                tree.add(prev[0], -1)
                alive[prev[0]] -= 1
            last[key] = (t, pos, lo, extra)
        tree.add(t, len(keys))
        alive[t] = len(keys)
        accesses[cell] += len(keys)
        access_bytes[cell] += len(keys) * u
    return _totals(caps, hits, hit_bytes, accesses, access_bytes)


def _count(hits: list[int], hit_bytes: list[int], lo: int, extra: frozenset[int] | None, u: int) -> None:
    """Add one access's hit set to a cell's difference arrays."""
    hits[lo] += 1
    hit_bytes[lo] += u
    for i in extra or ():
        hits[i] += 1
        hits[i + 1] -= 1
        hit_bytes[i] += u
        hit_bytes[i + 1] -= u


def _hit_set(
    prev: Touch,
    key: Key,
    distinct: int,
    replay: Replay,
    last: dict[Key, Touch],
    alive: list[int],
    caps: list[int],
) -> tuple[int, frozenset[int] | None]:
    """The capacities (as indices into `caps`) at which `key`, last touched as `prev`, hits now, given
    `distinct` keys touched in the forwards since (D in the module docstring)."""
    t0, p0, lo0, extra0 = prev
    start = bisect_right(caps, distinct)  # capacities up to D miss
    lo = bisect_right(caps, distinct + alive[t0] - 1, start)  # capacities above D + g hit
    if start == lo:
        return lo, None
    before, after = [], []  # t0's other keys still last touched there, by their place in t0
    for pos, other in enumerate(replay.keys[t0]):
        if pos != p0:
            touch = last[other]
            if touch[0] == t0:
                (before if pos < p0 else after).append(touch)
    count = _count_small if (lo - start) * (len(before) + len(after)) <= 64 else _count_sorted
    window = [
        i for i, above in count(range(start, lo), lo0, extra0, before, after) if distinct + above < caps[i]
    ]
    while window and window[-1] == lo - 1:  # keep `extra` for the indices below a full run of hits
        lo = window.pop()
    return lo, frozenset(window) or None


def _count_small(
    window: range, lo0: int, extra0: frozenset[int] | None, before: list[Touch], after: list[Touch]
) -> Iterator[tuple[int, int]]:
    """(i, A at capacity index i) over the window, for few companions: one look at each.

    At index i, a key that hit at t0 has above it t0's later keys and its earlier misses; a key that
    missed, only t0's later misses."""
    for i in window:
        if i >= lo0 or (extra0 is not None and i in extra0):
            above = len(after)
            for _, _, lo, extra in before:
                above += i < lo and (extra is None or i not in extra)
        else:
            above = 0
            for _, _, lo, extra in after:
                above += i < lo and (extra is None or i not in extra)
        yield i, above


def _count_sorted(
    window: range, lo0: int, extra0: frozenset[int] | None, before: list[Touch], after: list[Touch]
) -> Iterator[tuple[int, int]]:
    """`_count_small` for many companions (a prefill forward's): misses counted by bisection."""
    missed_before, missed_after = _misses(before), _misses(after)
    for i in window:
        if i >= lo0 or (extra0 is not None and i in extra0):
            yield i, len(after) + missed_before(i)
        else:
            yield i, missed_after(i)


def _misses(touches: list[Touch]) -> Callable[[int], int]:
    """i -> how many of `touches` missed at capacity index i."""
    los = sorted(touch[2] for touch in touches)
    if not any(touch[3] for touch in touches):
        return lambda i: len(los) - bisect_right(los, i)
    extras = Counter(i for touch in touches if touch[3] for i in touch[3])  # hits below their lo
    return lambda i: len(los) - bisect_right(los, i) - extras[i]


def _totals(
    caps: list[int],
    hits: list[list[int]],
    hit_bytes: list[list[int]],
    accesses: list[int],
    access_bytes: list[int],
) -> dict[int, list[Cell]]:
    """Prefix sums of the difference arrays: per capacity, (hits, misses, bytes read) per cell."""
    out = {}
    run, run_bytes = [0] * 4, [0] * 4
    for i, capacity in enumerate(caps):
        for c in range(4):
            run[c] += hits[c][i]
            run_bytes[c] += hit_bytes[c][i]
        out[capacity] = [(run[c], accesses[c] - run[c], access_bytes[c] - run_bytes[c]) for c in range(4)]
    return out

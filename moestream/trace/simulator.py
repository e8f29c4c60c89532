"""Byte-budgeted replay of a router trace through the engine's own policy classes.

A budget buys `budget_bytes // slot_bytes` slots (the slot size the engine's cache charges, from the
header, else the expert size). Every forward goes through `ResidentSet.access_group` (or the subclass a
policy needs), so LRU here makes the same decisions as the engine's LRU. Compute is instantaneous: a
victim still used by the current forward is evicted at once (the engine would wait instead).

Policies: lru, lfu, predictive (learns when each expert is used next; `moestream.cache.predictive`),
partitioned-lru (per-layer quotas), static (pinned from the first half of the trace,
evaluated on the second), opt (Belady, the bound: needs the future), predictive-prefetch (the same with
the predictive policy) and lru-prefetch (LRU plus a
prefetch of the stale-gate prediction for the next layer, assumed to land before that layer runs).

Bounded work for many budgets: budgets that buy the same number of slots are replayed once; LRU replays
every budget in one pass (`moestream.trace.lru_stack`, checked against `run_policy` in the tests); and a
budget at or above a policy's `saturation` (every expert it ever holds fits, so nothing is evicted)
gives the results of that saturation capacity, reported without a replay.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from moestream.cache.partitions import PartitionedResidentSet, PinnedResidentSet, split_evenly
from moestream.cache.policy import (
    BeladyPolicy,
    LFUPolicy,
    LRUPolicy,
    ResidentSet,
    prefetch,
    slots_for_budget,
)
from moestream.cache.predictive import PredictivePolicy
from moestream.errors import CacheBudgetError
from moestream.trace.errors import TraceError
from moestream.trace.lru_stack import lru_counts
from moestream.trace.replay import Replay, build_replay
from moestream.trace.schema import PHASES, TraceHeader
from moestream.trace.table import Trace
from moestream.units import MiB, format_size

POLICIES = (
    "lru",
    "lfu",
    "predictive",
    "partitioned-lru",
    "static",
    "opt",
    "lru-prefetch",
    "predictive-prefetch",
)
LEARNING = ("predictive", "predictive-prefetch")  # they read each forward's routing counts (`Replay.uses`)
PREFETCHING = ("lru-prefetch", "predictive-prefetch")  # they need the trace's stale-gate predictions
ALIASES = {
    "belady": "opt",
    "plru": "partitioned-lru",
    "prefetch": "lru-prefetch",
    "lru+prefetch": "lru-prefetch",
}
_COUNTERS = ("hits", "misses", "bytes_read", "prefetch_bytes", "prefetched", "prefetch_used")


@dataclass
class Counters:
    """What one policy did in one cell (half x phase), summed over its forwards."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0  # demand misses + prefetches
    prefetch_bytes: int = 0
    prefetched: int = 0
    prefetch_used: int = 0  # prefetched keys that the forward they were fetched for hit

    def __iadd__(self, other: Counters) -> Counters:
        for name in _COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def capacity_for(budget_bytes: int, slot_bytes: int) -> int:
    """Slots a budget buys (`slots_for_budget`, as the engine's cache counts them); a budget below one slot
    is a user error. A budget far above the trace's keys costs no memory: slots are handed out lazily."""
    capacity = slots_for_budget(budget_bytes, slot_bytes)
    if capacity < 1:
        raise CacheBudgetError(
            f"a budget of {format_size(budget_bytes)} holds no expert slot of {format_size(slot_bytes)}"
        )
    return capacity


def run_policy(replay: Replay, policy: str, capacity: int, unit: list[int]) -> list[Counters]:
    """Replay every forward through `policy` with `capacity` slots. Returns Counters per cell (0..3).

    Args:
        unit: bytes read per expert miss, indexed by layer.
    """
    if policy == "lru":
        return _run(ResidentSet(capacity, LRUPolicy()), replay, unit)
    if policy == "lfu":
        return _run(ResidentSet(capacity, LFUPolicy()), replay, unit)
    if policy == "predictive":
        if replay.uses is None:
            raise ValueError("the predictive policy needs a replay built with uses=True")
        return _run(
            ResidentSet(capacity, PredictivePolicy(replay.layers, replay.n_experts)),
            replay,
            unit,
            uses=replay.uses,
        )
    if policy == "opt":
        return _run(ResidentSet(capacity, BeladyPolicy(replay.keys)), replay, unit)
    if policy == "partitioned-lru":
        return _run(PartitionedResidentSet(split_evenly(capacity, replay.layers)), replay, unit)
    if policy == "static":
        first = [i for i, c in enumerate(replay.cell) if c < 2]
        second = [i for i, c in enumerate(replay.cell) if c >= 2]
        return _run(
            PinnedResidentSet(capacity, rank_by_frequency(replay.keys[i] for i in first)),
            replay,
            unit,
            second,
        )
    if policy == "lru-prefetch":
        return _run_prefetch(ResidentSet(capacity, LRUPolicy()), replay, unit)
    if policy == "predictive-prefetch":
        if replay.uses is None:
            raise ValueError("the predictive policy needs a replay built with uses=True")
        policy_ = PredictivePolicy(replay.layers, replay.n_experts)
        return _run_prefetch(ResidentSet(capacity, policy_), replay, unit, replay.uses)
    raise ValueError(f"unknown policy {policy!r}")


def run_capacities(
    replay: Replay, policy: str, capacities: Iterable[int], unit: list[int]
) -> dict[int, list[Counters]]:
    """`run_policy` at each of `capacities`: capacity -> Counters per cell. LRU does all of them in one
    pass over the replay; the other policies replay once per capacity."""
    if policy == "lru":
        return {
            capacity: [Counters(h, m, b) for h, m, b in cells]
            for capacity, cells in lru_counts(replay, capacities, unit).items()
        }
    return {capacity: run_policy(replay, policy, capacity, unit) for capacity in sorted(set(capacities))}


def saturation(replay: Replay, policy: str) -> int:
    """The capacity from which `policy` never evicts on `replay`, so every larger one gives its results:
    the distinct keys routed (with those predicted, for a prefetching policy), or for partitioned-lru
    the least capacity whose even per-layer shares each hold their layer's keys."""
    routed = {key for keys in replay.keys for key in keys}
    if policy in PREFETCHING and replay.predicted is not None:
        return len(routed.union(*(keys for keys in replay.predicted if keys)))
    if policy != "partitioned-lru":
        return len(routed)
    per_layer = Counter(layer for layer, _ in routed)
    need = [per_layer[layer] for layer in replay.layers]
    low, high = len(routed), len(need) * max(need)  # shares grow with the capacity: bisect
    while low < high:
        mid = (low + high) // 2
        shares = split_evenly(mid, replay.layers)
        if all(shares[layer] >= n for layer, n in zip(replay.layers, need)):
            high = mid
        else:
            low = mid + 1
    return low


def rank_by_frequency(groups: Iterable[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Keys by the number of forwards that used them, most first; ties by first use (deterministic)."""
    counts: Counter[tuple[int, int]] = Counter()
    for keys in groups:
        counts.update(keys)
    return [key for key, _ in counts.most_common()]  # most_common keeps insertion order among ties


def _run(
    resident: ResidentSet,
    replay: Replay,
    unit: list[int],
    indices: Iterable[int] | None = None,
    uses: list[tuple[list[int], int]] | None = None,
) -> list[Counters]:
    # plain int lists instead of Counters objects in the hot loop: this loop is the simulator's speed
    hits, misses, nbytes = [0] * 4, [0] * 4, [0] * 4
    access, keys, layer, cell = resident.access_group, replay.keys, replay.layer, replay.cell
    for i in range(len(keys)) if indices is None else indices:
        h, m = access(keys[i]) if uses is None else access(keys[i], *uses[i])
        c = cell[i]
        hits[c] += len(h)
        if m:
            misses[c] += len(m)
            nbytes[c] += len(m) * unit[layer[i]]
    return [Counters(hits[c], misses[c], nbytes[c]) for c in range(4)]


def _run_prefetch(
    resident: ResidentSet, replay: Replay, unit: list[int], uses: list[tuple[list[int], int]] | None = None
) -> list[Counters]:
    """The resident set's policy, and after each forward of layer L, a prefetch of the predicted keys of
    layer L+1 (same step)."""
    if replay.predicted is None:
        raise ValueError("a prefetching policy needs a replay built with predictions")
    out = [Counters() for _ in range(4)]
    pending: tuple[set[tuple[int, int]], Counters] | None = None
    access, keys, layer, cell, predicted = (
        resident.access_group,
        replay.keys,
        replay.layer,
        replay.cell,
        replay.predicted,
    )
    for i in range(len(keys)):
        h, m = access(keys[i]) if uses is None else access(keys[i], *uses[i])
        counters = out[cell[i]]
        counters.hits += len(h)
        counters.misses += len(m)
        counters.bytes_read += len(m) * unit[layer[i]]
        if pending is not None:  # the prefetch issued by the previous forward was for this one
            fetched, issuer = pending
            issuer.prefetch_used += sum(1 for key in h if key in fetched)
            pending = None
        guess = predicted[i]
        if guess:
            admitted = prefetch(resident, guess)
            size = len(admitted) * unit[layer[i] + 1]
            counters.prefetched += len(admitted)
            counters.prefetch_bytes += size
            counters.bytes_read += size
            pending = (set(admitted), counters)
    return out


# --- from a trace to result records ------------------------------------------------------------------


@dataclass
class Sizes:
    """Bytes the replay counts: `unit[layer]` per miss, and the slot size that sets the capacity."""

    unit: list[int]
    slot_bytes: int
    notes: list[str]


def resolve_sizes(header: TraceHeader, layers: list[int], unit_bytes: int | None) -> Sizes:
    """Expert and slot sizes from the header, or from `unit_bytes` (which overrides the header's)."""
    notes = []
    if unit_bytes:
        if header.expert_bytes:
            notes.append(f"--unit-bytes {unit_bytes} overrides the header's expert sizes")
        unit = [unit_bytes] * header.n_layers
    elif header.expert_bytes:
        unit = list(header.expert_bytes)
    else:
        raise TraceError(
            f"the trace ({header.source or header.model_id}) records no expert byte size; pass --unit-bytes"
        )
    slots = header.slot_bytes or unit
    slot_bytes = max(slots[lay] for lay in layers)
    if len({slots[lay] for lay in layers}) > 1:
        notes.append(
            f"slot sizes differ between layers; every slot is counted at the largest, {slot_bytes} B"
        )
    return Sizes(unit, slot_bytes, notes)


def simulate(
    trace: Trace,
    policies: list[str],
    budgets: list[int],
    unit_bytes: int | None = None,
    prefetch_top: int | None = None,
    prefetch_min_score: float = 0.0,
) -> tuple[list[dict[str, Any]], Replay, Sizes]:
    """Replay `trace` under every (budget, policy). Returns (records, the replay, the sizes used).

    Each record: policy, budget_bytes, capacity_slots, phase, scope ("all", or "second-half": the half
    static pinning is evaluated on), tokens, hits, misses, hit_rate, bytes_read, mib_per_token (all
    reads, prefetches included), wait_mib_per_token (demand misses only), prefetch figures, synthetic.
    Prefetching policies read the top `prefetch_top` (default top_k) predicted experts of each token
    whose stale-gate score is at least `prefetch_min_score`.
    """
    prefetching = [p for p in policies if p in PREFETCHING]
    if prefetching and not trace.has_predictions:
        raise TraceError(
            f"{trace.header.source or 'the trace'} has no stale-gate predictions, which "
            f"{', '.join(prefetching)} need{'s' if len(prefetching) == 1 else ''}"
        )
    top = (prefetch_top or trace.header.top_k) if prefetching else None
    uses = any(p in LEARNING for p in policies)
    replay = build_replay(trace, top, uses=uses, min_score=prefetch_min_score)
    sizes = resolve_sizes(trace.header, replay.layers, unit_bytes)
    capacities = {budget: capacity_for(budget, sizes.slot_bytes) for budget in budgets}
    limits = {policy: saturation(replay, policy) for policy in policies}
    results = {
        policy: run_capacities(
            replay, policy, {min(c, limits[policy]) for c in capacities.values()}, sizes.unit
        )
        for policy in policies
    }
    sizes.notes += _saturation_notes(limits, max(capacities.values()), sizes.slot_bytes)
    records = []
    for budget in budgets:
        capacity = capacities[budget]
        for policy in policies:
            cells = results[policy][min(capacity, limits[policy])]
            base = {
                "policy": policy,
                "budget_bytes": budget,
                "capacity_slots": capacity,
                "synthetic": trace.header.synthetic,
            }
            scopes = ("second-half",) if policy == "static" else ("all", "second-half")
            records += [
                _record(base, scope, phase, cells, replay.tokens)
                for scope in scopes
                for phase in (1, 0)
                if _tokens(scope, phase, replay.tokens)
            ]
    return records, replay, sizes


def _saturation_notes(limits: dict[str, int], largest: int, slot_bytes: int) -> list[str]:
    """Say which budgets were reported from a smaller one's replay (none when no budget reaches one)."""
    if largest < min(limits.values()):
        return []
    by_limit: dict[int, list[str]] = {}
    for policy, limit in limits.items():
        by_limit.setdefault(limit, []).append(policy)
    parts = [
        f"from {format_size(limit * slot_bytes)} ({limit} slots) for {', '.join(names)}"
        for limit, names in sorted(by_limit.items())
    ]
    return [
        "budgets that hold every expert a policy ever keeps evict nothing, so they give the results of "
        f"the least such budget and are reported without a replay: {'; '.join(parts)}"
    ]


def _tokens(scope: str, phase: int, tokens: list[int]) -> int:
    return tokens[2 + phase] + (tokens[phase] if scope == "all" else 0)


def _record(
    base: dict[str, Any], scope: str, phase: int, cells: list[Counters], tokens: list[int]
) -> dict[str, Any]:
    total = Counters()
    total += cells[2 + phase]
    if scope == "all":
        total += cells[phase]
    n_tok = _tokens(scope, phase, tokens)
    accesses = total.hits + total.misses
    return {
        **base,
        "phase": PHASES[phase],
        "scope": scope,
        "tokens": n_tok,
        "hits": total.hits,
        "misses": total.misses,
        "hit_rate": total.hits / accesses if accesses else 0.0,
        "bytes_read": total.bytes_read,
        "mib_per_token": total.bytes_read / MiB / n_tok,
        "wait_mib_per_token": (total.bytes_read - total.prefetch_bytes) / MiB / n_tok,
        "prefetch_mib_per_token": total.prefetch_bytes / MiB / n_tok,
        "prefetched": total.prefetched,
        "prefetch_used": total.prefetch_used,
        "prefetch_used_fraction": total.prefetch_used / total.prefetched if total.prefetched else None,
    }

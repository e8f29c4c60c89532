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

Bounded work for many budgets: budgets that buy the same number of slots are replayed once; a budget at
or above a policy's `saturation` (every expert it ever holds fits, so nothing is evicted) gives the
results of that saturation capacity, reported without a replay; and `run_capacities`
(`moestream.trace.policy_replay`) runs LRU's budgets in one pass and the predictive policies' in lockstep.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from moestream.cache.partitions import split_evenly
from moestream.cache.policy import slots_for_budget
from moestream.errors import CacheBudgetError
from moestream.trace.errors import TraceError
from moestream.trace.policy_replay import (
    TIERED,
    Counters,
    Tier,
    rank_by_frequency,
    run_capacities,
    run_policy,
    run_tiered,
)
from moestream.trace.replay import Replay, build_replay
from moestream.trace.schema import PHASES, TraceHeader
from moestream.trace.table import Trace
from moestream.units import MiB, format_size

__all__ = [
    "Counters",
    "capacity_for",
    "rank_by_frequency",
    "run_capacities",
    "run_policy",
    "saturation",
    "simulate",
]

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


def capacity_for(budget_bytes: int, slot_bytes: int) -> int:
    """Slots a budget buys (`slots_for_budget`, as the engine's cache counts them); a budget below one slot
    is a user error. A budget far above the trace's keys costs no memory: slots are handed out lazily."""
    capacity = slots_for_budget(budget_bytes, slot_bytes)
    if capacity < 1:
        raise CacheBudgetError(
            f"a budget of {format_size(budget_bytes)} holds no expert slot of {format_size(slot_bytes)}"
        )
    return capacity


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
    gpu_tier: int | None = None,
) -> tuple[list[dict[str, Any]], Replay, Sizes]:
    """Replay `trace` under every (budget, policy). Returns (records, the replay, the sizes used).

    Each record: policy, budget_bytes, capacity_slots, phase, scope ("all", or "second-half": the half
    static pinning is evaluated on), tokens, hits, misses, hit_rate, bytes_read, mib_per_token (all
    reads, prefetches included), wait_mib_per_token (demand misses only), prefetch figures, synthetic.
    Prefetching policies read the top `prefetch_top` (default top_k) predicted experts of each token
    whose stale-gate score is at least `prefetch_min_score`. `gpu_tier` (bytes): a GPU tier in front of
    each budget's host cache, as the engine's `--gpu-tier` with misses copied in (`cache/tiers.py`; lru
    or lfu): a hit is then a key either held, and the records add gpu_tier_bytes and gpu_tier_hit_rate.
    """
    if gpu_tier is not None:
        other = [p for p in policies if p not in TIERED]
        if other:
            raise TraceError(f"--gpu-tier replays {' or '.join(TIERED)}, not {', '.join(other)}")
    prefetching = [p for p in policies if p in PREFETCHING]
    if prefetching and not trace.has_predictions:
        raise TraceError(
            f"{trace.header.source or 'the trace'} has no stale-gate predictions, which "
            f"{', '.join(prefetching)} need{'s' if len(prefetching) == 1 else ''}"
        )
    top = (prefetch_top or trace.header.top_k) if prefetching else None
    uses = any(p in LEARNING for p in policies) or gpu_tier is not None  # (the tier's gate counts uses)
    # a trace regrouped into rounds (`batch_steps`): the engine runs a round's forwards side by side where
    # it streams experts on the host, but one after the other with prefetch or a GPU tier; each replay is
    # built where a policy takes it (they hold the same forwards and tokens, in another order)
    side_by_side = trace.round is not None and gpu_tier is None
    in_turn = (
        build_replay(trace, top, uses=uses, min_score=prefetch_min_score)
        if prefetching or not side_by_side
        else None
    )
    side = (
        build_replay(trace, None, uses=uses, side_by_side=True)
        if side_by_side and len(prefetching) < max(len(policies), 1)
        else None
    )
    replays = {p: side if side is not None and p not in PREFETCHING else in_turn for p in policies}
    replay = in_turn if in_turn is not None else side
    sizes = resolve_sizes(trace.header, replay.layers, unit_bytes)
    capacities = {budget: capacity_for(budget, sizes.slot_bytes) for budget in budgets}
    if gpu_tier is not None:  # every capacity replayed (the tiers are exclusive below `every`)
        tier = _tier(trace.header, replay, gpu_tier, sizes.slot_bytes)
        limits = {policy: max(capacities.values()) for policy in policies}
        results = {p: run_tiered(replay, p, capacities.values(), sizes.unit, tier) for p in policies}
        sizes.notes.append(
            f"a GPU tier of {format_size(gpu_tier)} ({tier.slots} slots, {tier.spare} lent to the misses its "
            "gate keeps out where the host cache streams) in front of each budget, misses copied in: a hit "
            "is an expert either held (JSON: gpu_tier_hit_rate, the tier's part)"
        )
    else:
        limits = {policy: saturation(replays[policy], policy) for policy in policies}
        results = {
            policy: run_capacities(
                replays[policy], policy, {min(c, limits[policy]) for c in capacities.values()}, sizes.unit
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
            if gpu_tier is not None:
                base["gpu_tier_bytes"] = gpu_tier
            scopes = ("second-half",) if policy == "static" else ("all", "second-half")
            records += [
                _record(base, scope, phase, cells, replay.tokens)
                for scope in scopes
                for phase in (1, 0)
                if _tokens(scope, phase, replay.tokens)
            ]
    return records, replay, sizes


def _tier(header: TraceHeader, replay: Replay, nbytes: int, slot_bytes: int) -> Tier:
    """The GPU tier `nbytes` buys (slots of the host cache's size), refused below one token's experts."""
    slots = slots_for_budget(nbytes, slot_bytes)
    top_k = header.top_k
    if slots < top_k:
        raise CacheBudgetError(
            f"--gpu-tier {format_size(nbytes)} holds {slots} experts of {format_size(slot_bytes)}, fewer "
            f"than the {top_k} a token routes to: give it at least {format_size(top_k * slot_bytes)}"
        )
    return Tier(slots, top_k, len(replay.layers) * replay.n_experts)


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
    tier = (
        {"gpu_tier_hit_rate": total.tier_hits / accesses if accesses else 0.0}
        if "gpu_tier_bytes" in base
        else {}
    )
    return {
        **tier,
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

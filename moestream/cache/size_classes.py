"""A byte budget carved into size classes of slots: what a budget must hold, what it buys, and the
slot memory itself (one aligned allocation per class, each with its `ResidentSet`)."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from moestream.cache.policy import EvictionPolicy, ResidentSet, slots_for_budget
from moestream.cache.slots import slot_bytes
from moestream.errors import CacheBudgetError
from moestream.io.memory import AlignedBuffer
from moestream.store.experts import ExpertMap
from moestream.units import format_size

Key = tuple[int, int]  # (layer, expert)


@dataclass
class SizeClass:
    """All slots of one size, carved from one aligned allocation."""

    slot_bytes: int
    capacity: int
    buffer: AlignedBuffer
    residents: ResidentSet


def budget_requirements(emap: ExpertMap, top_k: int) -> tuple[int, int]:
    """(one layer's worst case, one token's working set over all layers) in slot bytes."""
    per_layer = {}
    for (layer, _), parts in emap.units.items():
        per_layer[layer] = max(per_layer.get(layer, 0), slot_bytes(parts))
    return top_k * max(per_layer.values()), top_k * sum(per_layer.values())


def plan_classes(emap: ExpertMap, budget: int, top_k: int) -> list[tuple[int, int, list[Key]]]:
    """(slot bytes, slots, experts) of every size class a cache of `budget` bytes carves, before anything
    is allocated: each class gets its share of the budget, at least top_k slots, at most its experts."""
    by_size: dict[int, list[Key]] = {}
    for key, parts in emap.units.items():
        by_size.setdefault(slot_bytes(parts), []).append(key)
    total = sum(size * len(keys) for size, keys in by_size.items())
    plan = []
    for size, keys in sorted(by_size.items()):
        share = budget * size * len(keys) // total if len(by_size) > 1 else budget
        plan.append((size, slots_for_budget(share, size, floor=top_k, limit=len(keys)), keys))
    return plan


def planned_bytes(emap: ExpertMap, budget: int, top_k: int) -> int:
    """Bytes a cache of `budget` would allocate (less than the budget when every expert fits)."""
    return sum(size * capacity for size, capacity, _ in plan_classes(emap, budget, top_k))


def check_budget(emap: ExpertMap, budget: int, top_k: int, warn_working_set: bool) -> None:
    """Refuse a budget below one layer's worst case; warn (to the cache's caller) below one token's
    working set.

    Raises:
        CacheBudgetError: the budget cannot hold one layer's top_k largest experts.
    """
    minimum, working_set = budget_requirements(emap, top_k)
    if budget < minimum:
        raise CacheBudgetError(
            f"cache budget {format_size(budget)} is below one layer's worst case "
            f"(top_k {top_k} x largest expert slot = {format_size(minimum)}, {minimum} bytes); "
            f"use a cache of at least {format_size(minimum)}"
        )
    if warn_working_set and budget < working_set:
        warnings.warn(
            f"cache budget {format_size(budget)} is smaller than one token's working set over all layers "
            f"({format_size(working_set)}): expect most experts to be read again for every token",
            RuntimeWarning,
            stacklevel=3,
        )


def carve(
    emap: ExpertMap, budget: int, top_k: int, policy_factory: Callable[[], EvictionPolicy]
) -> tuple[list[SizeClass], dict[Key, SizeClass]]:
    """Allocate the size classes `plan_classes` plans. Returns them and each expert's class."""
    classes, class_of = [], {}
    for size, capacity, keys in plan_classes(emap, budget, top_k):
        cls = SizeClass(
            size, capacity, AlignedBuffer(size * capacity), ResidentSet(capacity, policy_factory())
        )
        classes.append(cls)
        class_of.update((key, cls) for key in keys)
    return classes, class_of


def holds_all(classes: list[SizeClass], class_of: dict[Key, SizeClass]) -> bool:
    """Whether every class has a slot for each of its experts (nothing need ever be evicted)."""
    held = collections.Counter(id(cls) for cls in class_of.values())
    return all(cls.capacity >= held[id(cls)] for cls in classes)


def begin_group(
    classes: list[SizeClass],
    class_of: dict[Key, SizeClass],
    layer: int,
    experts: list[int],
    uses: list[int] | None,
    tokens: int,
) -> None:
    """Each size class's policy hears of a forward's keys that are its own, in order."""
    if len(classes) == 1:
        classes[0].residents.begin_group([(layer, e) for e in experts], uses, tokens)
        return
    for cls in classes:
        mine = [i for i, e in enumerate(experts) if class_of[(layer, e)] is cls]
        if mine:
            cls.residents.begin_group(
                [(layer, experts[i]) for i in mine],
                None if uses is None else [uses[i] for i in mine],
                tokens,
            )

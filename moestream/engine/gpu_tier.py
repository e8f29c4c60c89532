"""A GPU tier smaller than the model's experts, on a ggml backend (`--gpu-tier`): device slots that the
policy fills from the host expert cache (which holds every expert, or, smaller, reads a miss from disk).

Slots come in size classes, one per combination of the experts' matrix types (a Q4_K_M file's layers
whose down is Q6_K make one class, those whose down is Q4_K another): a class has one device region per
matrix kind (gate, up, down), each of `slots` matrices of that kind's own bytes, back to back (ggml's
CUDA kernels step between experts in whole blocks), so one slot index addresses an expert's three
matrices and one ggml_mul_mat_id per kind computes a layer's experts from their slots (ids = slots).
The budget is shared between the classes in proportion to the bytes of their experts (as the host
cache carves its own, `cache/size_classes.py`), so every layer gets about the same number of slots.

Which (layer, expert) holds which slot is a `ResidentSet` per class, its policy one of `cache/policy`'s
(the classes the simulator replays): a layer's experts are the group the policy hears of, its hits are
touched, its misses admitted, never evicting another expert of the same layer (those are pinned while
the layer's graph reads them); each miss is copied from the host slot its caller names (where the host
cache holds it, pinned) into its device slot on the backend's stream, ordered before the next compute.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from moestream.cache.admission import FrequencyGate
from moestream.cache.policy import EvictionPolicy, ResidentSet, execution_order, slots_for_budget, uses_of
from moestream.cache.tiers import lent_slots
from moestream.engine.stats import TierCounters
from moestream.errors import CacheBudgetError
from moestream.ggml.backend import DeviceMemory, Region
from moestream.runtime.expert_layers import ExpertTypes, SlotArena
from moestream.units import format_size


@dataclass(frozen=True)
class ClassPlan:
    """One size class before anything is allocated: each kind's bytes, its slots, its layers."""

    kinds: tuple[tuple[str, int], ...]  # (kind, bytes of one expert's matrix)
    slots: int
    layers: tuple[int, ...]

    @property
    def slot_bytes(self) -> int:
        return sum(n for _, n in self.kinds)


def _classes(types: dict[int, ExpertTypes], layers: list[int], hidden: int) -> dict[tuple, list[int]]:
    """Each size class's kinds ((kind, bytes of one expert's matrix), ...) -> its layers."""
    by_kinds: dict[tuple, list[int]] = {}
    for layer in layers:
        by_kinds.setdefault(types[layer].matrix_bytes(hidden), []).append(layer)
    return by_kinds


def expert_bytes(types: dict[int, ExpertTypes], layers: list[int], hidden: int, experts: int) -> int:
    """Every routed expert's bytes of the MoE `layers` (`experts` each), as the device lays them out."""
    return experts * sum(sum(n for _, n in types[layer].matrix_bytes(hidden)) for layer in layers)


def minimum_budget(
    types: dict[int, ExpertTypes], layers: list[int], hidden: int, experts: int, top_k: int
) -> int:
    """The smallest GPU tier whose every size class has slots for one token's `top_k` routed experts."""
    by_kinds = _classes(types, layers, hidden)
    total = expert_bytes(types, layers, hidden, experts)
    return max(-(-top_k * total // (len(ls) * experts)) for ls in by_kinds.values())


def plan_tier(
    types: dict[int, ExpertTypes], layers: list[int], hidden: int, experts: int, budget: int, top_k: int
) -> list[ClassPlan]:
    """The size classes a GPU tier of `budget` bytes carves for the MoE `layers` (each with `experts`
    experts; `types`: how the graphs see them): each class's share of the budget in proportion to its
    experts' bytes, so every class gets the same slots per layer.

    Raises:
        CacheBudgetError: a class gets fewer slots than one token's `top_k` routed experts.
    """
    by_kinds = _classes(types, layers, hidden)
    total = expert_bytes(types, layers, hidden, experts)
    plans = []
    for kinds, ls in by_kinds.items():
        size = sum(n for _, n in kinds)
        share = budget * size * len(ls) * experts // total
        slots = slots_for_budget(share, size, limit=len(ls) * experts)
        if slots < top_k:
            least = minimum_budget(types, layers, hidden, experts, top_k)
            raise CacheBudgetError(
                f"--gpu-tier {format_size(budget)} holds {slots} of the {format_size(size)} experts of "
                f"{_layers(ls)}, fewer than the {top_k} one token routes to: give it at least "
                f"{format_size(least)}"
            )
        plans.append(ClassPlan(kinds, slots, tuple(ls)))
    return plans


def _layers(layers: list[int]) -> str:
    """'layer 3', 'layers 0, 2', 'layers 0-46 (24)'."""
    if len(layers) == 1:
        return f"layer {layers[0]}"
    listed = ", ".join(map(str, layers)) if len(layers) <= 4 else f"{layers[0]}-{layers[-1]} ({len(layers)})"
    return f"layers {listed}"


@dataclass
class _Class:
    plan: ClassPlan
    pools: dict[str, Region]  # kind -> the device region of its `slots` matrices
    residents: ResidentSet
    gate: FrequencyGate  # each key's uses, for a gated admission (`place`)
    spare: int = 0  # device slots after the residents' (from `residents.capacity` on), `lend`'s


class GpuTier:
    """Device slots over the host cache's slots (`host`: each MoE layer's experts there, slot s of its
    size class at s times the arena's slot bytes). `types` gives the graphs the device slots instead."""

    def __init__(
        self,
        memory: DeviceMemory,
        host: dict[int, ExpertTypes],
        plans: list[ClassPlan],
        policy: Callable[[], EvictionPolicy],
        exclusive: bool = False,
        spare: int = 0,
    ) -> None:
        """`exclusive` (a host cache that does not hold every expert): the keys the tier's admissions evict
        are kept for `take_evicted` (the host cache takes them back, as the tier below an exclusive one).
        `spare`: each class keeps that many of its slots out of the residents', for misses copied in for
        one graph only (`lend`; where the class has at least twice as many slots)."""
        self.memory, self.host = memory, host
        self.counters = TierCounters()
        self._classes: list[_Class] = []
        self._class_of: dict[int, _Class] = {}
        self.types: dict[int, ExpertTypes] = {}
        try:
            for k, plan in enumerate(plans):
                lent = lent_slots(plan.slots, spare)
                c = _Class(plan, {}, ResidentSet(plan.slots - lent, policy()), FrequencyGate(), lent)
                if exclusive:
                    c.residents.evicted = []
                self._classes.append(c)
                for kind, nbytes in plan.kinds:
                    c.pools[kind] = memory.alloc(plan.slots * nbytes, f"tier{k}.{kind}")
                address = {kind: r.device for kind, r in c.pools.items()}
                arena = SlotArena(address, 0, plan.slots, dict(plan.kinds))
                for layer in plan.layers:
                    self._class_of[layer] = c
                    self.types[layer] = dataclasses.replace(host[layer], arena=arena)
        except BaseException:
            self.close()
            raise

    def place(
        self, layer: int, rows: list[list[int]], gated: bool = False
    ) -> tuple[dict[int, int], list[int]] | None:
        """Each token's experts of `layer` (`rows`, in router order) given device slots: (expert -> slot,
        the misses, whose bytes the caller copies in with `upload`, or `forget`s); None when they are
        more than the layer's class has slots (a prefill chunk's union: the caller computes them from
        the host tier instead). `gated` (the caller computes the misses elsewhere): a miss is admitted
        only as the class's `FrequencyGate` allows; one it refuses has no slot in the map."""
        c = self._class_of[layer]
        if len(rows) == 1 and len(set(rows[0])) == len(rows[0]):  # a decoded token: each expert once
            experts, uses = rows[0], [1] * len(rows[0])
        else:
            experts = execution_order(rows)
            uses = list(uses_of(experts, rows).values())
        if len(experts) > c.residents.capacity:
            return None
        keys = [(layer, e) for e in experts]
        # the simulator's protocol (`ResidentSet.access_group`): the policy hears of the group, hits are
        # touched, misses admitted without evicting one of the group (pinned: the layer's graph reads them)
        residents = c.residents
        c.gate.count(keys, uses)
        admits = c.gate.admits if gated else None
        _, missed = residents.access_group(keys, uses, len(rows), admits)
        slot_of, slot = residents.slot_of, {}
        for e, key in zip(experts, keys):
            s = slot_of(key)
            if s is not None:
                slot[e] = s
        misses = [e for _, e in missed]
        self.counters.hits += len(experts) - len(misses)
        self.counters.misses += len(misses)
        return slot, misses

    def admit(self, layer: int, experts: list[int], group: list[int]) -> dict[int, int]:
        """Slots for `experts` (misses of `layer` that a gated `place` kept out, to be copied in now),
        never evicting one of `group` (the layer's experts) while another can go: expert -> slot."""
        c = self._class_of[layer]
        protected = {(layer, e) for e in group}
        return {e: c.residents.admit((layer, e), protected)[0] for e in experts}

    def lend(self, layer: int, experts: list[int]) -> dict[int, int] | None:
        """Spare slots for `experts` (misses of `layer` a gated `place` kept out, to be copied in for the
        next graph only: the next layer's misses take the same slots, after it on the stream): expert ->
        slot; None where the class has fewer spare slots (the caller `admit`s them instead)."""
        c = self._class_of[layer]
        if len(experts) > c.spare:
            return None
        first = c.residents.capacity
        self.counters.lent += len(experts)
        return {e: first + j for j, e in enumerate(experts)}

    def lends(self, layer: int) -> bool:
        """Whether `layer`'s class has spare slots (`lend`)."""
        return self._class_of[layer].spare > 0

    def upload(self, layer: int, slot: int, kinds: tuple[str, ...], source: int) -> None:
        """`kinds` of the expert in host slot `source` (of `layer`'s host size class) into device `slot`,
        on the backend's stream (the host slot must not change until the stream has run them)."""
        c = self._class_of[layer]
        host = self.host[layer].arena
        sizes = dict(c.plan.kinds)
        for kind in kinds:
            nbytes = sizes[kind]
            address = host.address[kind] + source * host.slot_bytes
            self.memory.upload_from(c.pools[kind], slot * nbytes, address, nbytes)
            self.counters.bytes_uploaded += nbytes

    def missing(self, layer: int, experts: list[int]) -> list[int]:
        """Which of `experts` of `layer` hold no device slot (what a read-ahead into the host cache is
        for)."""
        residents = self._class_of[layer].residents
        return [e for e in experts if (layer, e) not in residents]

    def forget(self, layer: int, experts: list[int]) -> None:
        """`experts` placed but never uploaded (a read failed, or the host cache no longer held one): out
        of the tier, so they miss again rather than be computed from another expert's bytes."""
        residents = self._class_of[layer].residents
        for e in experts:
            if (layer, e) in residents:
                residents.remove((layer, e))

    def take_evicted(self) -> list[tuple[int, int]]:
        """The (layer, expert)s the tier's admissions evicted since the last call (none unless made
        `exclusive`)."""
        out: list[tuple[int, int]] = []
        for c in self._classes:
            if c.residents.evicted:
                out += c.residents.evicted
                c.residents.evicted.clear()
        return out

    def close(self) -> None:
        for c in self._classes:
            for region in c.pools.values():
                self.memory.release(region)
        self._classes, self._class_of, self.types = [], {}, {}


class WayTrial:
    """MOESTREAM_TIER_MISSES=auto: the way of a miss chosen per run by measurement. The first `window`
    decode steps (one token each) copy misses in ("upload"), the next `window` compute them on the CPU
    ("host"), the next `window` do both at once ("split": a share of each layer's misses copied while
    the CPU computes the rest, the share from the first two: the CPU's step time over both, so that
    copies and CPU would end together); from then on the way whose median step was shortest. Which is
    fastest depends on the machine (the copies' bandwidth against the CPU's cores) and the tier's
    share. Plain Python: `record` is told each step's seconds, `way` says the way of the next."""

    WAYS = ("upload", "host", "split")

    def __init__(self, window: int = 8) -> None:
        self.window = window
        self.seconds: dict[str, list[float]] = {w: [] for w in self.WAYS}
        self.chosen: str | None = None
        self._share = 0.5  # the way "split"'s, once "upload" and "host" are timed
        self._words = "on trial"

    def way(self) -> str:
        if self.chosen is not None:
            return self.chosen
        return next(w for w in self.WAYS if len(self.seconds[w]) < self.window)

    def median(self, way: str) -> float | None:
        return statistics.median(self.seconds[way]) if self.seconds[way] else None

    def share(self) -> float:
        """The way "split"'s share of the misses copied: host / (upload + host), their median steps (0.5
        until both are timed)."""
        return self._share

    def record(self, way: str, seconds: float) -> None:
        """A decode step of `way` took `seconds` (ignored once the choice is made)."""
        if self.chosen is not None:
            return
        self.seconds[way].append(seconds)
        if way == "host" and len(self.seconds[way]) == self.window:
            up, host = self.median("upload"), self.median("host")
            self._share = host / (up + host) if up and host else 0.5
        if all(len(self.seconds[w]) >= self.window for w in self.WAYS):
            self.chosen = min(self.WAYS, key=self.median)
            others = ", ".join(f"{w} {1000 * self.median(w):.1f}" for w in self.WAYS if w != self.chosen)
            self._words = (
                f"{self.chosen} (a decode step {1000 * self.median(self.chosen):.1f} ms; {others}; split "
                f"copied {self._share:.0%})"
            )

    def describe(self) -> str:
        """E.g. 'split (a decode step 9.1 ms; upload 15.1, host 18.4; split copied 55%)' once chosen, else
        'on trial'."""
        return self._words


# what a device needs beside the trunk, the KV cache, the graphs' buffers and the experts: CUDA's own
# workspaces (cuBLAS, ggml's pool of temporaries, which grows to a prefill chunk's largest), at least
AUTO_MARGIN = 512 << 20


def tier_room(free: int, reserve: int) -> int:
    """What a device with `free` bytes free leaves the routed experts after `reserve` (the trunk, the KV
    cache, the graphs' buffers) and the margin (AUTO_MARGIN, or 1/20 of `free` where more)."""
    return free - reserve - max(AUTO_MARGIN, free // 20)


def auto_tier(free: int, reserve: int, every: int, least: int, holds_all: bool) -> int | None:
    """`--gpu-tier auto` on a device with `free` bytes free, `reserve` of them for the trunk, the KV cache
    and the graphs: None (every expert in stacks on the device, the step one graph) where `every` expert's
    bytes fit beside the reserve and the host cache holds them all; else a tier of what is left (at most
    `every`: slots for every expert over a host cache that streams).

    Raises:
        CacheBudgetError: what is left is less than `least` (one token's routed experts a class).
    """
    room = tier_room(free, reserve)
    if every <= room and holds_all:
        return None
    if room < least:
        raise CacheBudgetError(
            f"--gpu-tier auto: the GPU has {format_size(free)} free, {format_size(reserve)} of it for the "
            f"trunk, KV cache and graphs, which leaves less than the {format_size(least)} one token's "
            "experts need: free GPU memory, or run on the CPU (--device cpu)"
        )
    return min(room, every)

"""`ExpertLayers`: the routed experts of every MoE layer as a `ModelRunner` reaches them, one typed door.

A runner (engine/runners.py, engine/ggml_runner.py) never reaches into a `StreamingExperts` module's
runtime, the cache or the tier: it asks this door whether the routing must come back to the host
(a trace, a routing replay, prefetch), has a layer's experts computed by the schedule (hits at once,
each miss as its bytes land), or, where they are cached, gets their slots in place for its graphs
(pinned, then unpinned), the slots of a model cached whole, or the device slot tables of a GPU tier
that holds every expert; and it reads the counters. The loaded model owns one door for its life and
binds it to each expert streaming it builds (at load, after each restream: `generation` counts them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moestream import ggml
from moestream.cache.policy import execution_order, uses_of
from moestream.runtime.experts import ExpertRuntime, Routed
from moestream.runtime.held_experts import HeldExperts
from moestream.runtime.resident import ResidentExperts, unavailable
from moestream.runtime.streaming import ExpertStreaming, StreamCounters


@dataclass(frozen=True)
class SlotArena:
    """Where a layer's cached experts lie: in one size class of the expert cache, each kind at the same
    place in every slot, so one ggml_mul_mat_id over the whole class computes any of them by slot."""

    address: dict[str, int]  # kind -> its bytes in slot 0
    slot_bytes: int
    slots: int
    # kind -> the distance between its experts where it is not slot_bytes: a device's stacks of each
    # kind's experts back to back (ggml's CUDA kernels step between experts in whole blocks)
    strides: dict[str, int] | None = field(default=None, compare=False)
    # kind -> (ggml buffer, kernels) of a copy in ggml's repacked layout (`engine/repacked.py`): the
    # graphs mark that kind's weights with them (`ggml.repack.Repacker.mark`)
    repacked: dict[str, tuple[int, int]] | None = field(default=None, compare=False)

    def stride(self, kind: str) -> int:
        return self.slot_bytes if self.strides is None else self.strides[kind]


@dataclass(frozen=True)
class ExpertTypes:
    """One MoE layer's routed experts as the graphs compute them (gate and up [I, H], down [H, I])."""

    gate: int  # ggml types
    up: int
    down: int
    inter: int
    arena: SlotArena | None  # None: the slots' layout differs between experts (no cached path)
    # gpt-oss: kind -> f32 [E, out] bias rows by expert id (ggml_add_id), and (alpha, limit) of
    # ggml_swiglu_oai; else none and ggml_swiglu_split
    biases: dict[str, torch.Tensor] | None = field(default=None, compare=False)
    oai: tuple[float, float] | None = None

    def shapes(self, hidden: int) -> dict[str, tuple[int, int, int]]:
        """kind -> (ggml type, columns, rows) of one expert's matrix, for gate, up and down."""
        return {
            "gate": (self.gate, hidden, self.inter),
            "up": (self.up, hidden, self.inter),
            "down": (self.down, self.inter, hidden),
        }

    def stored_types(self) -> tuple[int, ...]:
        """The ggml types of the kinds computed from the blocks as stored (not from a repacked copy)."""
        repacked = self.arena.repacked or {} if self.arena is not None else {}
        kinds = (("gate", self.gate), ("up", self.up), ("down", self.down))
        return tuple(t for kind, t in kinds if kind not in repacked)

    def matrix_bytes(self, hidden: int) -> tuple[tuple[str, int], ...]:
        """(kind, bytes of one expert's matrix of that kind) for gate, up and down, as ggml lays them
        out (a whole number of blocks a row)."""
        shapes = self.shapes(hidden).items()
        return tuple((kind, rows * ggml.row_bytes(t, cols)) for kind, (t, cols, rows) in shapes)


class ExpertLayers:
    """The MoE layers' routed experts of the expert streaming bound now (`bind`)."""

    def __init__(self, streaming: ExpertStreaming, top_k: int) -> None:
        self.top_k = top_k
        self.layers = sorted(streaming.emap.layers)  # the MoE layers
        self.num_experts = streaming.emap.num_experts
        self.generation = 0  # bumped by each `bind`: a runner's graphs over the old slots are stale
        self.bind(streaming)

    def bind(self, streaming: ExpertStreaming) -> None:
        """Serve the experts of `streaming` from now on (a new one: at load, and after a restream)."""
        self._streaming = streaming
        self._types: dict[int, ExpertTypes] | None = None
        self._whole: tuple[int, dict[int, int] | None] | None = None  # (cache version, slots) looked up
        self.generation += 1

    @property
    def _runtime(self) -> ExpertRuntime:
        return self._streaming.runtime

    # --- where the routing goes -----------------------------------------------------------------

    def host_routing(self) -> bool:
        """Whether each layer's routing must reach the host between layers: a trace records it, a routing
        replay replaces it, prefetch reads ahead from it, or the tier's slots cannot be read in place.
        Where not, cached experts can be computed in the runner's graphs."""
        rt = self._runtime
        return self.steps_in_order() or bool(rt.observers) or not rt.tier.in_place

    def steps_in_order(self) -> bool:
        """Whether each layer's routing is followed a step at a time, layer after layer: a routing replay
        replaces it from its recorded order, prefetch reads the next layer ahead from it (its gate scores
        each guess against the next layer's routing). A trace does not: it is told each step's rows."""
        rt = self._runtime
        return rt.replay is not None or rt.prefetch is not None

    def replaying(self) -> bool:
        """Whether a routing replay replaces each layer's routing."""
        return self._runtime.replay is not None

    def every_position(self) -> bool:
        """Whether every position's routing is wanted on the host (a trace records, a routing replay
        replaces each position's): a prefill chunk's FFN past the last attention then runs on every
        position, not the last one only (prefetch reads ahead for them either way)."""
        rt = self._runtime
        return rt.replay is not None or bool(rt.observers)

    # --- a layer's experts by the schedule --------------------------------------------------------

    def forward(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """`compute`, summed: [T, H], each token's experts times their weights (what transformers'
        experts module returns)."""
        return self._runtime.forward(layer, hidden, top_k_index, top_k_weights)

    def compute(
        self,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        queued: Callable[[], None] | None = None,
        apart: bool = False,
    ) -> Routed:
        """Every routed expert's output of `layer` (hidden [T, H], the routing [T, K]), not summed: hits
        at once, each miss as its bytes land (`ExpertRuntime.experts`; a replay's routing where one runs).
        `queued`: the layer's routing was `heard` already; run once the reads are queued (a read-ahead).
        `apart`: the rows are a batch of sequences, each to get the bits it gets alone (`ggml.tiled`)."""
        return self._runtime.experts(layer, hidden, top_k_index, top_k_weights, queued, apart)

    def heard(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> tuple[int, list[int]] | None:
        """A layer's routing that a device's graph worked out (hidden [T, H], routing [T, K] on the host),
        heard as `compute` hears it: the prefetch gate scores its guess, a trace records it. Returns the
        next MoE layer's confident guesses (None without prefetch), for `read_ahead`."""
        return self._runtime.heard(layer, hidden, top_k_index, top_k_weights)

    def read_ahead(self, predicted: tuple[int, list[int]] | None) -> None:
        """Once per MoE layer forward that `heard` heard, once its own reads are queued: the gate asked,
        and where it allows, `predicted` read ahead into the host cache behind those reads."""
        self._runtime.read_ahead(predicted)

    def counters(self) -> StreamCounters:
        """The streaming's cumulative counters (bytes read, hits, misses, waits, prefetches)."""
        return self._streaming.counters()

    # --- cached experts in place, for the graphs --------------------------------------------------

    def graph_types(self) -> dict[int, ExpertTypes]:
        """MoE layer -> how the graphs see its experts, where the schedule computes them with the graphs'
        kernels (ggml_mul_mat_id); with their slots' layout when cached ones can be computed in the
        graphs. Worked out once per streaming (the slots' layout walks every expert's parts: on the
        trained fixture, 12 ms of a new prompt length's 20-40)."""
        if self._types is None:
            self._types = self._work_out_types()
        return self._types

    def _work_out_types(self) -> dict[int, ExpertTypes]:
        from moestream import ggml
        from moestream.runtime.formats.ggml import Ggml

        rt, types = self._runtime, {}
        for layer in self.layers:
            terms = rt.family.graph_terms(layer)
            kinds = ("gate_up", "down") if terms is not None and terms.halves else ("gate", "up", "down")
            fmts = [rt.formats.get((layer, kind)) for kind in kinds]
            if terms is None or not all(isinstance(f, Ggml) and f.by_id for f in fmts):
                continue  # the schedule computes them, always
            inter = fmts[0].rows // 2 if terms.halves else fmts[0].rows
            arena = rt.cache.slot_arena(layer)
            if arena is not None:
                base, slot_bytes, slots, offsets = arena
                address = {kind: base + off for kind, off in offsets.items()}
                # blocks as GGUF aligns them; floats (a safetensors file's odd header) by element
                align = max({0: 4, 1: 2, 30: 2}.get(f.type.id, ggml.WEIGHT_ALIGNMENT) for f in fmts)
                aligned = not any(a % align for a in address.values())
                if terms.halves:  # up's rows right after gate's (blocks, which ggml reads unaligned)
                    gate_up = address.pop("gate_up")
                    address.update(gate=gate_up, up=gate_up + inter * fmts[0].row_bytes)
                arena = SlotArena(address, slot_bytes, slots) if aligned else None
            ids = [f.type.id for f in fmts]
            ids = [ids[0], *ids] if terms.halves else ids
            types[layer] = ExpertTypes(*ids, inter, arena, terms.biases, terms.oai)
        return types

    def resident_slots(self) -> dict[int, int] | None:
        """MoE layer -> the slot of its expert 0 (expert e in slot first + e) when every expert of the
        model is cached for good, each layer's slots in place for the graphs, and nothing needs the
        routing on the host (`host_routing`); else None. Looked up again only after a key entered or
        left a slot (the cache's `version`)."""
        if self.host_routing():
            return None
        cache = self._runtime.cache
        if self._whole is not None and self._whole[0] == cache.version:
            return self._whole[1]
        first: dict[int, int] | None = None
        if cache.holds_all():
            types = self.graph_types()
            first = {}
            for layer in self.layers:
                t = types.get(layer)
                slot = cache.first_slot(layer, self.num_experts) if t is not None and t.arena else None
                if slot is None:
                    first = None
                    break
                first[layer] = slot
        self._whole = (cache.version, first)
        return first

    def holds_all(self) -> bool:
        """Whether the expert cache has a slot for every expert (it never evicts one)."""
        return self._runtime.cache.holds_all()

    def cache_version(self) -> int:
        """The expert cache's `version`: bumped whenever a key enters or leaves a slot."""
        return self._runtime.cache.version

    def slot_regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of the host slots the MoE layers' experts sit in (what `graph_types`'
        arenas address): their contents change as the cache evicts and reads."""
        regions = set()
        for layer in self.layers:
            arena = self._runtime.cache.slot_arena(layer)
            if arena is not None:
                base, slot_bytes, slots, _ = arena
                regions.add((base, slot_bytes * slots))
        return sorted(regions)

    def count_resident(self, hits: int, layers: int | None = None) -> None:
        """A step computed whole from the slots (`resident_slots`), or `layers` of its MoE layers computed
        from copies of them (a GPU tier): its `hits` counted by the cache, each layer's experts as one
        call."""
        rt = self._runtime
        rt.cache.count_hits(hits)
        rt.layer_calls += len(self.layers) if layers is None else layers

    def pin(self, layer: int, rows: list[list[int]], heard: bool = False) -> dict[int, int] | None:
        """Each token's experts of `layer` (`rows`, in router order) pinned in their slots when the cache
        holds every one and nothing needs the routing on the host (or it was `heard` already): expert ->
        its slot (the policy hears of the forward as the schedule would tell it); None to compute them
        by `compute` instead. `unpin` them once the graph that reads the slots ran."""
        if self.host_routing() and not heard:
            return None
        rt = self._runtime
        experts = execution_order(rows)
        uses = uses_of(experts, rows)
        pinned = rt.cache.pin_all_hits(layer, experts, list(uses.values()), len(rows))
        if pinned is None:
            return None
        rt.layer_calls += 1
        return {e: s for e, (s, _) in zip(experts, pinned)}

    def unpin(self, layer: int, experts: list[int]) -> None:
        """Give back the slots `pin` or `pin_read` pinned (evictable again)."""
        self._runtime.cache.unpin_hits(layer, experts)

    # --- host slots to copy from (a GPU tier's misses) ------------------------------------------

    def hold(self, layer: int, experts: list[int], uses: list[int], tokens: int) -> HeldExperts:
        """`experts` of `layer` (distinct, in execution order; `uses[i]` of the `tokens` routed to
        `experts[i]`) held in host slots as a layer forward of the cache holds them: the policy hears of
        the group, hits are pinned, misses read from disk, each kind said as it lands (`HeldExperts`)."""
        rt = self._runtime
        terms = rt.family.graph_terms(layer)
        halves = terms is not None and terms.halves
        kinds = {k: ("gate", "up") if halves and k == "gate_up" else (k,) for k in rt.emap.kinds}
        return HeldExperts(rt.cache, rt.cache.open_layer(layer, experts, uses, tokens), kinds)

    def pin_read(self, layer: int, experts: list[int]) -> dict[int, int]:
        """expert -> its host slot, pinned, for each of `experts` of `layer` still read in full in the
        cache (what the schedule just computed), without telling the policy or counting a hit; `unpin`."""
        return self._runtime.cache.pin_read(layer, experts)

    def demote(self, layer: int, experts: list[int]) -> None:
        """`experts` of `layer` were copied into a GPU tier: the host cache evicts them first (exclusive
        tiers: together they hold more experts than either)."""
        if experts:
            self._runtime.cache.demote([(layer, e) for e in experts])

    def keep(self, keys: list[tuple[int, int]]) -> None:
        """(layer, expert)s a GPU tier evicted: kept in the host cache as used now where still there."""
        self._runtime.cache.keep(keys)

    # --- device slot tables (a GPU tier holding every expert) ------------------------------------

    def device_tables(self) -> ResidentExperts | None:
        """The one-token experts of every MoE layer from device tables of slot offsets, where the GPU
        tier can hold every expert and each layer batches one token (`runtime/resident.py`); else None."""
        if unavailable(self._runtime, self.top_k) is not None:
            return None
        return ResidentExperts(self._runtime, self.top_k)

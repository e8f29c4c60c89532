"""What kernels that read the expert cache's slots in place ask of it (the ggml graphs: one
ggml_mul_mat_id over a layer's slots): whether every expert has a slot, where a layer's slots and its
experts' bytes are, and hits taken and given back without a `LayerJob`.

`InPlaceSlots` is a part of `ExpertCache` (its base class), kept apart from the streaming bookkeeping;
it works on the cache's state under the cache's lock, as the cache's own methods do.
"""

from __future__ import annotations

from moestream.cache.bookkeeping_lock import BookkeepingLock
from moestream.cache.records import CacheStats, SlotState
from moestream.cache.size_classes import Key, SizeClass, begin_group
from moestream.cache.slot_layout import SlotLayout


class InPlaceSlots:
    """`ExpertCache`'s methods for kernels that read its slots in place. Uses the cache's attributes
    below and its `_check_open`, `_take_hit` and `_unpin`."""

    lock: BookkeepingLock
    stats: CacheStats
    classes: list[SizeClass]
    layout: SlotLayout
    _states: dict[Key, SlotState]
    _class_of: dict[Key, SizeClass]
    _holds_all: bool

    def holds_all(self) -> bool:
        """Whether every expert of the map has a slot of its own (nothing need ever be evicted): fixed
        when the classes are carved (each class gets at most its experts' slots)."""
        return self._holds_all

    def pin_all_hits(
        self, layer: int, experts: list[int], uses: list[int], tokens: int, alignment: int = 1
    ) -> list[tuple[int, dict[str, int]]] | None:
        """A forward of `layer` over `experts` (distinct, in execution order; `uses[i]` of its `tokens`
        routed to `experts[i]`) when every one is in place, read in full, each kind in one part at an
        `alignment`-aligned address: what `open_layer` would do for them (the policy's `begin_group`,
        a touch and a pin per expert, the hits counted); returns each expert's (slot in its size
        class, address of each kind). None, having done nothing, when any is not so. Give the pins
        back with `unpin_hits`."""
        self._check_open()
        with self.lock:
            states = []
            for e in experts:
                state = self._states.get((layer, e))
                if state is None or self.layout.addresses(state, alignment) is None:
                    return None
                states.append(state)
            begin_group(self.classes, self._class_of, layer, experts, uses, tokens)
            for state in states:
                self._take_hit(state)
            self.stats.hits += len(experts)
        return [(state.slot, state.addresses) for state in states]

    def pin_read(self, layer: int, experts: list[int]) -> dict[int, int]:
        """expert -> its slot in its size class, for each of `experts` of `layer` read in full, pinned
        without the policy hearing of it or a hit counted (a copy out of the slot of an expert its layer
        has just used); one not in a slot is left out. Give the pins back with `unpin_hits`."""
        self._check_open()
        with self.lock:
            slots = {}
            for e in experts:
                state = self._states.get((layer, e))
                if state is not None and not state.failed and not any(state.remaining.values()):
                    state.pins += 1
                    slots[e] = state.slot
        return slots

    def slot_arena(self, layer: int) -> tuple[int, int, int, dict[str, int]] | None:
        """(buffer address, slot bytes, slots, kind -> offset of its bytes in a slot) when every expert
        of `layer` sits in one size class with each kind, one part, at the same offset in its slot (a
        multiple of 4 KiB per expert keeps the file offsets' remainders equal; other layers' kinds are
        moved to their regions' starts once read, `SlotLayout.move_to_start`); else None."""
        return self.layout.arena(layer, self._class_of)

    def first_slot(self, layer: int, experts: int) -> int | None:
        """The slot of `layer`'s expert 0 when each of its `experts` is read in full, expert e in slot
        first + e of the one size class, while the cache `holds_all` (so none is ever evicted: the slots
        stay until a key leaves, which bumps `version`); else None."""
        with self.lock:
            first = None
            for e in range(experts):
                state = self._states.get((layer, e))
                if state is None or self.layout.addresses(state, 1) is None:
                    return None
                first = state.slot - e if first is None else first
                if state.slot != first + e:
                    return None
            return first

    def count_hits(self, hits: int) -> None:
        """Hits served without `open_layer` (every expert cached: one graph computed them)."""
        with self.lock:
            self.stats.hits += hits

    def unpin_hits(self, layer: int, experts: list[int]) -> None:
        """Give back the pins `pin_all_hits` took."""
        with self.lock:
            for e in experts:
                self._unpin(self._states[(layer, e)])

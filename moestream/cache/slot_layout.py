"""Where each kind's bytes sit in an expert's slot once read, and the rewrites that put them there.

`slots.py` lays one expert's parts out as they are read: each part lands `head` bytes into its aligned
region. Two rewrites after a read make the layout the same for every expert of a layer, so kernels can
read the slots in place (one ggml_mul_mat_id over a layer's slots): a layer whose experts start at
different heads has each kind moved to its region's start once read (`move_to_start`), and a kind with a
`Repack` (gpt-oss's MXFP4, transposed experts) is rewritten as one part at its first region's start
(`convert`). `SlotLayout` decides both, before any read, and says where the bytes are afterwards.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import replace

from moestream.cache.records import SlotState
from moestream.cache.size_classes import Key, SizeClass
from moestream.cache.slots import PartRead, Repack, plan_parts, region_bytes
from moestream.errors import ExpertReadError
from moestream.io.memory import AlignedBuffer
from moestream.io.reader import Reader, Request
from moestream.store.experts import ExpertMap


class SlotLayout:
    """The slot layout of every expert of `emap`: its part reads, which layers are moved, which kinds
    repacked, and where each kind's bytes start once read."""

    def __init__(self, emap: ExpertMap) -> None:
        self.emap = emap
        self._plans: dict[Key, dict[str, list[PartRead]]] = {}  # each expert's part reads, computed once
        self._repack: dict[tuple[int, str], Repack] = {}  # (layer, kind) -> how it is rewritten once read
        self._moved = self._layers_to_move()

    def plan(self, key: Key) -> dict[str, list[PartRead]]:
        """kind -> part reads of expert `key` in its slot."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_parts(self.emap.kinds, self.emap.units[key])
        return plan

    def _layers_to_move(self) -> frozenset[int]:
        """Layers whose experts' bytes start at different places in their slots (an expert's size not a
        multiple of 4 KiB puts each at another offset within its aligned read), each kind in one part:
        once a kind is read, its bytes are moved to the start of its region (`move_to_start`), so every
        expert of the layer has each kind at the same offset in its slot and one ggml_mul_mat_id over
        the slots computes any of them. The other layers need no move."""
        heads: dict[int, set[tuple[int, ...]]] = {}
        single: dict[int, bool] = {}
        for (layer, _), parts in self.emap.units.items():
            plan = plan_parts(self.emap.kinds, parts)  # repacked kinds start at their region's start
            kept = [reads for kind, reads in plan.items() if (layer, kind) not in self._repack]
            heads.setdefault(layer, set()).add(tuple(p.head for reads in kept for p in reads))
            single[layer] = single.get(layer, True) and all(len(r) == 1 for r in kept)
        return frozenset(layer for layer, h in heads.items() if len(h) > 1 and single[layer])

    def set_repacks(self, repacks: dict[tuple[int, str], Repack]) -> None:
        """Rewrite these (layer, kind)s once read (`ExpertCache.repack`, before any read).

        Raises:
            ValueError: a rewritten kind would not fit its regions.
        """
        for (layer, e), parts in self.emap.units.items():
            for kind, refs in parts.items():
                r = repacks.get((layer, kind))
                if r is not None and r.nbytes > sum(region_bytes(ref.nbytes) for ref in refs):
                    raise ValueError(f"layer {layer} expert {e}: {kind} repacked needs {r.nbytes} bytes")
        self._repack = dict(repacks)
        self._moved = self._layers_to_move()

    def repack_of(self, layer: int, kind: str) -> Repack | None:
        """How `layer`'s `kind` is rewritten once read, if it is."""
        return self._repack.get((layer, kind))

    def start(self, layer: int, kind: str, reads: list[PartRead]) -> int | None:
        """Where a kind's bytes start in a slot once read, when they are one part (None: several)."""
        if (layer, kind) in self._repack:
            return reads[0].region_offset
        if len(reads) != 1:
            return None
        return reads[0].region_offset + self.head(layer, reads[0])

    def head(self, layer: int, part: PartRead) -> int:
        """Where `part`'s bytes start in its region once read (0 where they were moved there)."""
        return 0 if layer in self._moved else part.head

    def tensor_parts(self, state: SlotState, kind: str) -> list[tuple[AlignedBuffer, int, PartRead]]:
        """(buffer, offset of the tensor's first byte in it, part) for each part of a kind in its slot."""
        layer = state.key[0]
        repack = self._repack.get((layer, kind))
        if repack is not None:  # one part now, where the first one's region starts
            p = state.plan[kind][0]
            return [
                (
                    state.cls.buffer,
                    state.base + p.region_offset,
                    replace(p, ref=replace(p.ref, nbytes=repack.nbytes)),
                )
            ]
        return [
            (state.cls.buffer, state.base + p.region_offset + self.head(layer, p), p)
            for p in state.plan[kind]
        ]

    def addresses(self, state: SlotState, alignment: int) -> dict[str, int] | None:
        """kind -> address of a fully read expert's one part of each kind (kept: a slot's bytes do not
        change until it is evicted), or None."""
        if state.addresses is None:
            if state.failed or any(state.remaining.values()):
                return None
            layer = state.key[0]
            starts = {kind: self.start(layer, kind, reads) for kind, reads in state.plan.items()}
            if None in starts.values():
                return None
            base = state.cls.buffer.address + state.base
            state.addresses = {kind: base + start for kind, start in starts.items()}
        if any(a % alignment for a in state.addresses.values()):
            return None
        return state.addresses

    def arena(
        self, layer: int, class_of: dict[Key, SizeClass]
    ) -> tuple[int, int, int, dict[str, int]] | None:
        """`ExpertCache.slot_arena`: (buffer address, slot bytes, slots, kind -> offset in a slot) when
        every expert of `layer` sits in one size class with each kind, one part, at one offset."""
        keys = [key for key in self.emap.units if key[0] == layer]
        classes = {id(class_of[key]) for key in keys}
        layouts = {
            tuple((kind, self.start(layer, kind, reads)) for kind, reads in plan.items())
            for plan in (plan_parts(self.emap.kinds, self.emap.units[key]) for key in keys)
        }
        if len(classes) != 1 or len(layouts) != 1:
            return None
        layout = next(iter(layouts))
        if any(off is None for _, off in layout):
            return None
        cls = class_of[keys[0]]
        return cls.buffer.address, cls.slot_bytes, cls.capacity, dict(layout)

    def requests(
        self,
        state: SlotState,
        kind: str,
        priority: tuple,
        reader: Reader,
        piece_bytes: int,
        on_done: Callable[[SlotState, str, BaseException | None], None],
    ) -> list[Request]:
        """One read request per part of `kind` into its region of the slot (the reader splits each into
        pieces); each calls `on_done(state, kind, error-or-None)` when it lands."""
        requests = []
        for part_rank, part in enumerate(state.plan[kind]):
            dest = state.base + part.region_offset
            requests.append(
                Request(
                    priority=(*priority, part_rank),
                    seq=reader.next_seq(),
                    file=reader.open(part.ref.file),
                    offset=part.file_offset,
                    length=part.length,
                    needed=part.head + part.ref.nbytes,
                    dest=state.cls.buffer.view[dest : dest + part.length],
                    dest_address=state.cls.buffer.address + dest,
                    piece=piece_bytes,
                    on_done=lambda err, s=state, k=kind: on_done(s, k, err),
                )
            )
        return requests

    def move_to_start(self, state: SlotState, kind: str) -> None:
        """A kind read in full without error: in a moved layer (not repacked), its bytes go to the start
        of their region, the same offset in every slot."""
        if self._repack.get((state.key[0], kind)) is not None or state.key[0] not in self._moved:
            return
        base = state.cls.buffer.address + state.base
        for p in state.plan[kind]:
            ctypes.memmove(base + p.region_offset, base + p.region_offset + p.head, p.ref.nbytes)

    @staticmethod
    def convert(state: SlotState, kind: str, repack: Repack) -> BaseException | None:
        """Rewrite a kind just read into its kernels' layout (`repack`); returns the failure, if any."""
        view, base = state.cls.buffer.view, state.base
        parts = [view[base + p.region_offset + p.head :][: p.ref.nbytes] for p in state.plan[kind]]
        start = base + state.plan[kind][0].region_offset
        try:
            repack.convert(parts, view[start : start + repack.nbytes])
        except Exception as exc:  # bad bytes must not be served: the waiting layer raises this
            return ExpertReadError(f"expert {state.key} {kind} could not be repacked ({exc})")
        return None

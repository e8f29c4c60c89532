"""Slot geometry: where each part of an expert lands in a slot, and the aligned reads that fill it.

A part of `n` bytes at file offset `o` is read as the 4096-aligned superset [o & ~4095, ...) of length
round_up(head + n, 4096), head = o % 4096, into a region of round_up(n, 4096) + 4096 bytes, which always
holds it. The tensor's bytes then start `head` bytes into the region. Regions never overlap, so an
aligned tail can never overwrite a neighbour (the seed's gpt-oss bug came from sizing it otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moestream.store.safetensors_file import TensorRef
from moestream.units import round_up

ALIGN = 4096


def region_bytes(nbytes: int) -> int:
    """Bytes a part of `nbytes` occupies in a slot."""
    return round_up(nbytes, ALIGN) + ALIGN


@dataclass(frozen=True)
class PartRead:
    """How one part of one expert is read into its slot region."""

    ref: TensorRef
    region_offset: int  # from the slot's start, aligned
    file_offset: int  # aligned start of the read
    length: int  # aligned length of the read
    head: int  # where the tensor's bytes start inside the region


@dataclass(frozen=True)
class Repack:
    """How the cache rewrites one kind's parts in a slot once they are read: as one part of `nbytes` at
    the start of the kind's first region, in the layout its kernels read (gpt-oss's MXFP4 blocks and
    scales as ggml's 17-byte blocks). `convert(parts, out)` reads the parts' bytes (in order) and writes
    `out`, which overlaps them (so it reads them all before it writes)."""

    nbytes: int
    convert: Callable[[list[memoryview], memoryview], None]


def plan_parts(
    kinds: tuple[str, ...], parts_by_kind: dict[str, tuple[TensorRef, ...]]
) -> dict[str, list[PartRead]]:
    """Lay out one expert's parts in a slot, in kind order. Returns kind -> part reads."""
    cursor = 0
    plan: dict[str, list[PartRead]] = {}
    for kind in kinds:
        reads = []
        for ref in parts_by_kind[kind]:
            head = ref.offset % ALIGN
            reads.append(PartRead(ref, cursor, ref.offset - head, round_up(head + ref.nbytes, ALIGN), head))
            cursor += region_bytes(ref.nbytes)
        plan[kind] = reads
    return plan


def slot_bytes(parts_by_kind: dict[str, tuple[TensorRef, ...]]) -> int:
    """Bytes of one slot for an expert with these parts."""
    return sum(region_bytes(ref.nbytes) for parts in parts_by_kind.values() for ref in parts)

"""CUDA device tiers: GPU slots fed from pinned host slots by a copy stream, or unified (mapped) memory.

`GpuSlotTier`, from fast to slow: GPU slots (LRU unless told otherwise) <- pinned host slots (the
`ExpertCache`; O_DIRECT reads land there) <- the checkpoint on disk. A layer forward:
  * GPU-resident experts are computed at once (no host work but enqueueing kernels);
  * the others go through the host cache as on the CPU; when a kind's bytes are in pinned memory, the
    compute thread enqueues its copy on the copy stream and records an event, and the compute stream
    waits for that event on the GPU, so the copy of one expert overlaps the compute of another and the
    host never waits for the GPU;
  * in a GPU slot, a family's fusions (gate and up) are adjacent, so they are one matmul, the same
    operation transformers' eager experts run.
The one host synchronisation per layer is the readback of the routing, in the runtime.
Reusing a pinned host slot whose copy to the GPU might still be running waits for that copy's event;
those waits are counted in `TierStats.host_syncs` (a slot is reused long after its copy, so they are
normally zero). `UnifiedTier` (integrated GPUs: Jetson) has one tier of pinned, device-mapped host
slots that kernels read in place, with no staging copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moestream.cache.admission import admission_blocked
from moestream.cache.expert_cache import ExpertCache
from moestream.cache.policy import EvictionPolicy, LRUPolicy, ResidentSet, slots_for_budget
from moestream.cache.records import LayerJob
from moestream.errors import CacheBudgetError
from moestream.io.memory import AlignedBuffer
from moestream.runtime.tiers import DeviceTier
from moestream.store.experts import ExpertMap
from moestream.units import format_size, round_up

_ALIGN = 256  # start of every kind in a GPU slot (inside a fusion excepted)


@dataclass
class GpuSlot:
    slot: int
    pins: int = 0
    copied: dict[str, torch.cuda.Event] = field(default_factory=dict)  # kind -> copy done
    last_use: torch.cuda.Event | None = None  # compute done reading this slot


def gpu_layout(
    emap: ExpertMap, key: tuple[int, int], fusions: dict[str, tuple[str, ...]]
) -> tuple[dict[str, list[tuple[int, Any]]], int]:
    """Offsets of every part of one expert in a GPU slot: kind -> [(offset, ref)], and the slot size.
    Kinds of one fusion follow each other with no gap, so their bytes are one matrix."""
    fused_tail = {kinds[i] for kinds in fusions.values() for i in range(1, len(kinds))}
    cursor, layout = 0, {}
    for kind in emap.kinds:
        if kind not in fused_tail:
            cursor = round_up(cursor, _ALIGN)
        layout[kind] = []
        for ref in emap.units[key][kind]:
            layout[kind].append((cursor, ref))
            cursor += ref.nbytes
    return layout, round_up(cursor, _ALIGN)


def register_pinned(buffer: AlignedBuffer, mapped: bool = False) -> None:
    """Page-lock an existing host allocation (cudaHostRegister) for asynchronous copies, or, `mapped`,
    for kernels to read it in place (cudaHostRegisterMapped)."""
    err = torch.cuda.cudart().cudaHostRegister(buffer.address, buffer.nbytes, 2 if mapped else 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {format_size(buffer.nbytes)} failed with CUDA error {int(err)}"
        )


class _PinnedHost(DeviceTier):
    """What both CUDA tiers share: the host cache's slots page-locked (unpinned on close), and waits on
    GPU events before a host slot is refilled (counted)."""

    def __init__(self, cache: ExpertCache, device: torch.device, mapped: bool) -> None:
        super().__init__(cache, device)
        self._registered = [c.buffer for c in cache.classes]
        for buffer in self._registered:
            register_pinned(buffer, mapped=mapped)
        # id(host slot state) -> the last GPU work reading it; one stream orders the rest before it
        self._host_events: dict[int, torch.cuda.Event] = {}
        cache.on_evict = self._before_host_reuse

    def close(self) -> None:
        """Wait for the GPU, then unpin the host slots (before their memory can be unmapped)."""
        torch.cuda.synchronize(self.device)
        for buffer in self._registered:
            torch.cuda.cudart().cudaHostUnregister(buffer.address)
        self._registered = []

    def _note_host_use(self, host_state: Any, event: torch.cuda.Event) -> None:
        self._host_events[id(host_state)] = event

    def _before_host_reuse(self, host_state: Any) -> None:
        event = self._host_events.pop(id(host_state), None)
        if event is not None and not event.query():
            self.stats.host_syncs += 1
            event.synchronize()


class GpuSlotTier(_PinnedHost):
    """GPU slots in one allocation, with per-slot copy and last-use events, fed from pinned host slots."""

    fuses = True
    in_place = False  # a host slot's bytes reach the kernels through `prepare`'s copy

    def __init__(
        self,
        cache: ExpertCache,
        budget_bytes: int,
        device: torch.device,
        top_k: int,
        fusions: dict[str, tuple[str, ...]],
        policy: EvictionPolicy | None = None,
    ) -> None:
        emap = cache.emap
        layouts = {k: gpu_layout(emap, k, fusions) for k in emap.units}
        self.layouts = {k: layout for k, (layout, _) in layouts.items()}
        self.slot_bytes = max(size for _, size in layouts.values())
        capacity = slots_for_budget(budget_bytes, self.slot_bytes, limit=len(emap.units))
        if capacity < top_k:
            raise CacheBudgetError(
                f"GPU cache {format_size(budget_bytes)} holds fewer than top_k {top_k} experts of "
                f"{format_size(self.slot_bytes)}; use a GPU cache of at least "
                f"{format_size(top_k * self.slot_bytes)}"
            )
        super().__init__(cache, device, mapped=False)
        self.capacity, self.fusions = capacity, fusions
        self.buffer = torch.empty(capacity * self.slot_bytes, dtype=torch.uint8, device=device)
        self.gpu_bytes = self.buffer.nbytes
        self.residents = ResidentSet(capacity, policy or LRUPolicy())
        self.slots: dict[tuple[int, int], GpuSlot] = {}
        self.copy_stream = torch.cuda.Stream(device=device)
        self._compute_stream = torch.cuda.current_stream(device)
        self._layer_keys: set[tuple[int, int]] = set()
        self.version = 0  # changes whenever an expert enters or leaves a GPU slot (runtime/resident.py)

    def holds_all(self) -> bool:
        """Every routed expert of the model is in a GPU slot."""
        return len(self.residents) == len(self.cache.emap.units)

    def begin_group(self, layer: int, order: list[int], uses: list[int], tokens: int) -> None:
        self.residents.begin_group([(layer, e) for e in order], uses, tokens)

    def split(self, layer: int, order: list[int]) -> tuple[list[int], list[int]]:
        self._compute_stream = torch.cuda.current_stream(self.device)  # looked up once per layer (it is slow)
        self._layer_keys = {(layer, e) for e in order}  # never evicted from the GPU for each other
        ready = [e for e in order if (layer, e) in self.residents]
        for expert in ready:
            key = (layer, expert)
            self.residents.touch(key)
            self.slots[key].pins += 1
        # the host copies kept warm, so that a GPU eviction can fall back to them
        self.cache.keep([(layer, e) for e in ready])
        self.stats.gpu_hits += len(ready)
        return ready, [e for e in order if (layer, e) not in self.residents]

    def missing(self, layer: int, experts: list[int]) -> list[int]:
        return [e for e in experts if (layer, e) not in self.residents]

    def prepare(self, job: LayerJob, expert: int, kinds: tuple[str, ...]) -> bool:
        key = (job.layer, expert)
        state = self.slots.get(key)
        if state is None:
            if admission_blocked(self.residents, self._layer_keys, self._pinned):
                return False  # every GPU slot is held by this layer's unfinished experts
            slot, evicted = self.residents.admit(key, self._layer_keys)
            self.version += 1
            previous = self.slots.pop(evicted, None) if evicted is not None else None
            state = self.slots[key] = GpuSlot(slot, pins=1)
            if previous is not None:
                state.last_use = previous.last_use  # a copy into this slot must wait for its old readers
            self.stats.gpu_misses += 1
        missing = [kind for kind in kinds if kind not in state.copied]
        if missing:
            with torch.cuda.stream(self.copy_stream):
                for kind in missing:
                    self._copy(job, key, kind, state)
        for kind in kinds:
            self._compute_stream.wait_event(state.copied[kind])
        return True

    def _pinned(self, key: object) -> bool:
        state = self.slots.get(key)  # type: ignore[arg-type]
        return state is not None and state.pins > 0

    def _copy(self, job: LayerJob, key: tuple[int, int], kind: str, state: GpuSlot) -> None:
        """Enqueue host slot -> GPU slot for one kind on the copy stream (current); record its event."""
        if state.last_use is not None:
            self.copy_stream.wait_event(state.last_use)
        host_state = self.cache.state_of(key)
        for (buffer, offset, _), (gpu_offset, ref) in zip(
            job.tensor_parts(key[1], kind), self.layouts[key][kind]
        ):
            src = self._views.bytes_of(buffer)[offset : offset + ref.nbytes]
            dst_start = state.slot * self.slot_bytes + gpu_offset
            self.buffer[dst_start : dst_start + ref.nbytes].copy_(src, non_blocking=True)
            self.stats.copy_bytes += ref.nbytes
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        state.copied[kind] = event
        self._note_host_use(host_state, event)

    def release(self, layer: int, expert: int, job: LayerJob | None, failed: bool) -> None:
        key = (layer, expert)
        state = self.slots.get(key)
        if state is None:
            return
        state.pins -= 1
        if failed:
            self.residents.remove(key)
            del self.slots[key]
            self.version += 1
        else:
            event = torch.cuda.Event()
            event.record(self._compute_stream)
            state.last_use = event

    def abort(self, layer: int) -> None:
        """Every pin of the failed forward is dropped; a slot that did not get all its kinds copied is given
        up (served later, it would compute with missing bytes). Its kernels' outputs are discarded, so
        nothing waits for them; a host slot they copy from is only refilled after its copy event."""
        event = torch.cuda.Event()
        event.record(self._compute_stream)
        kinds = set(self.cache.emap.kinds)
        for key, state in list(self.slots.items()):
            if state.pins == 0:
                continue
            state.pins = 0
            if kinds.issubset(state.copied):
                state.last_use = event
            else:
                self.residents.remove(key)
                del self.slots[key]
                self.version += 1

    def raws(self, layer: int, expert: int, kind: str, job: LayerJob | None) -> list[torch.Tensor]:
        key = (layer, expert)
        base = self.slots[key].slot * self.slot_bytes
        layout = self.layouts[key]
        if kind in self.fusions:  # the fused kinds' parts, back to back: one byte range
            first, *_ = layout[self.fusions[kind][0]]
            size = sum(ref.nbytes for part in self.fusions[kind] for _, ref in layout[part])
            return [self.buffer[base + first[0] : base + first[0] + size]]
        return [self.buffer[base + offset : base + offset + ref.nbytes] for offset, ref in layout[kind]]

    def describe(self) -> str:
        return (
            f"gpu cache {format_size(self.capacity * self.slot_bytes)} = {self.capacity} slots, "
            f"pinned host cache {format_size(self.cache.allocated_bytes)} = {self.cache.capacity} slots"
        )


class UnifiedTier(_PinnedHost):
    """One tier for integrated GPUs: pinned, device-mapped host slots that kernels read in place.

    O_DIRECT reads land in the slots; the GPU computes straight from them (no staging copy). A slot is
    refilled only after the kernels that read its previous expert are done (their event is waited for;
    the waits are counted in `host_syncs`).
    """

    def __init__(self, cache: ExpertCache, device: torch.device) -> None:
        super().__init__(cache, device, mapped=True)
        self._aliases = {id(buffer): device_alias(buffer, device) for buffer in self._registered}

    def raws(self, layer: int, expert: int, kind: str, job: LayerJob | None) -> list[torch.Tensor]:
        return [
            self._aliases[id(buffer)][offset : offset + part.ref.nbytes]
            for buffer, offset, part in job.tensor_parts(expert, kind)
        ]

    def release(self, layer: int, expert: int, job: LayerJob | None, failed: bool) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._note_host_use(self.cache.state_of((layer, expert)), event)

    def describe(self) -> str:
        c = self.cache
        return (
            f"unified memory cache {format_size(c.budget_bytes)} = {c.capacity} slots "
            f"(pinned, device-mapped, no staging copy)"
        )


class _CudaArray:
    """`__cuda_array_interface__` for a device-visible byte range, so torch can alias it."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def device_alias(buffer: AlignedBuffer, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor over mapped pinned host memory (with unified addressing the device pointer
    is the host pointer), for GPUs that read host memory in place."""
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(buffer.address, buffer.nbytes), device=device)

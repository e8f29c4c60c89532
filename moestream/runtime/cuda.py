"""Experts computed on an NVIDIA GPU: a GPU slot tier fed from pinned host slots by a copy stream.

Tiers, from fast to slow: GPU slots (`GpuTier`, LRU) <- pinned host slots (the `ExpertCache`, LRU,
O_DIRECT reads land there) <- the checkpoint on disk. A layer forward:
  * GPU-resident experts are computed at once (no host work but enqueueing kernels);
  * the others go through the host cache as on the CPU; when a kind's bytes are in pinned memory, the
    compute thread enqueues its copy on the copy stream and records an event, and the compute stream
    waits for that event on the GPU, so the copy of one expert overlaps the compute of another and the
    host never waits for the GPU;
  * the layer's routing goes to the GPU in one asynchronous copy (`ExpertRuntime._routes`);
  * in a GPU slot, gate and up are adjacent ([2I,H], gate rows first), so gate+up is one matmul, the
    same operation transformers' eager experts run.
The one host synchronisation per layer is the readback of the routing (`top_k_index.tolist()`).
Reusing a pinned host slot whose copy to the GPU might still be running waits for that copy's event;
those waits are counted in `CudaStats.host_syncs` (a slot is reused long after its copy, so they are
normally zero).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moestream.cache.expert_cache import ExpertCache, LayerJob
from moestream.cache.policy import EvictionPolicy, LRUPolicy, ResidentSet
from moestream.errors import CacheBudgetError
from moestream.io.memory import AlignedBuffer
from moestream.runtime.experts import ExpertRuntime, Route
from moestream.runtime.weights import TORCH_DTYPES
from moestream.store.experts import ExpertMap
from moestream.units import format_size, round_up

_ALIGN = 256  # start of every kind in a GPU slot (the gate->up boundary excepted)


@dataclass
class CudaStats:
    gpu_hits: int = 0
    gpu_misses: int = 0  # experts copied host -> GPU
    copy_bytes: int = 0
    host_syncs: int = 0  # waits on a copy event before reusing a pinned host slot


@dataclass
class GpuSlot:
    slot: int
    pins: int = 0
    copied: dict[str, torch.cuda.Event] = field(default_factory=dict)  # kind -> copy done
    last_use: torch.cuda.Event | None = None  # compute done reading this slot


def gpu_layout(emap: ExpertMap, key: tuple[int, int]) -> tuple[dict[str, list[tuple[int, Any]]], int]:
    """Offsets of every part of one expert in a GPU slot: kind -> [(offset, ref)], and the slot size."""
    cursor, layout = 0, {}
    for kind in emap.kinds:
        if kind != "up":  # up must directly follow gate so that [gate; up] is one [2I,H] matrix
            cursor = round_up(cursor, _ALIGN)
        layout[kind] = []
        for ref in emap.units[key][kind]:
            layout[kind].append((cursor, ref))
            cursor += ref.nbytes
    return layout, round_up(cursor, _ALIGN)


class GpuTier:
    """GPU slots in one allocation (LRU unless told otherwise), with per-slot copy and last-use events."""

    def __init__(
        self,
        emap: ExpertMap,
        budget_bytes: int,
        device: torch.device,
        top_k: int,
        policy: EvictionPolicy | None = None,
    ) -> None:
        self.layouts = {k: gpu_layout(emap, k)[0] for k in emap.units}
        self.slot_bytes = max(gpu_layout(emap, k)[1] for k in emap.units)
        capacity = min(len(emap.units), budget_bytes // self.slot_bytes)
        if capacity < top_k:
            raise CacheBudgetError(
                f"GPU cache {format_size(budget_bytes)} holds fewer than top_k {top_k} experts of "
                f"{format_size(self.slot_bytes)}; use a GPU cache of at least {format_size(top_k * self.slot_bytes)}"
            )
        self.capacity, self.device = capacity, device
        self.buffer = torch.empty(capacity * self.slot_bytes, dtype=torch.uint8, device=device)
        self.residents = ResidentSet(capacity, policy or LRUPolicy())
        self.slots: dict[tuple[int, int], GpuSlot] = {}

    def victim_free(self, protected: set[tuple[int, int]]) -> bool:
        """Whether admitting one more expert would not evict a slot in use by the current layer."""
        victim = self.residents.next_victim(protected)
        return victim is None or self.slots[victim].pins == 0

    def admit(self, key: tuple[int, int], protected: set[tuple[int, int]]) -> GpuSlot:
        slot, evicted = self.residents.admit(key, protected)
        previous = self.slots.pop(evicted, None) if evicted is not None else None
        state = GpuSlot(slot, pins=1)
        if previous is not None:
            state.last_use = previous.last_use  # a copy into this slot must wait for its old readers
        self.slots[key] = state
        return state


class _PinnedHostRuntime(ExpertRuntime):
    """What both CUDA runtimes share: the host cache's slots page-locked (unpinned on close), routes sent
    to the GPU asynchronously, and waits on GPU events before a host slot is refilled (counted)."""

    def __init__(
        self, cache: ExpertCache, act_fn: Any, device: torch.device, mapped: bool, **kwargs: Any
    ) -> None:
        super().__init__(cache, act_fn, **kwargs)
        self.device = device
        self.cuda_stats = CudaStats()
        self._registered = [c.buffer for c in cache.classes]
        for buffer in self._registered:
            register_pinned(buffer, mapped=mapped)
        # id(host slot state) -> the last GPU work reading it; one stream per runtime orders the rest before it
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
            self.cuda_stats.host_syncs += 1
            event.synchronize()


class CudaExpertRuntime(_PinnedHostRuntime):
    """Routed experts on a CUDA device, fed by `GpuTier` <- pinned `ExpertCache` <- disk."""

    def __init__(self, cache: ExpertCache, gpu: GpuTier, act_fn: Any, **kwargs: Any) -> None:
        super().__init__(cache, act_fn, gpu.device, mapped=False, **kwargs)
        self.gpu = gpu
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self._compute_stream = torch.cuda.current_stream(self.device)
        self._layer_keys: set[tuple[int, int]] = set()

    def _stage_kinds(self) -> list[tuple[str, ...]]:
        if self.emap.family == "swiglu":
            return [("gate", "up"), ("down",)]
        return [(kind,) for kind in self.emap.kinds]

    def _compute(
        self,
        layer: int,
        order: list[int],
        hidden: torch.Tensor,
        routes: dict[int, Route],
        predicted: tuple[int, list[int]] | None = None,
    ) -> dict[int, torch.Tensor]:
        self._compute_stream = torch.cuda.current_stream(self.device)  # looked up once per layer (it is slow)
        self._layer_keys = {(layer, e) for e in order}  # never evicted from the GPU for each other
        resident = [e for e in order if (layer, e) in self.gpu.residents]
        rest = [e for e in order if (layer, e) not in self.gpu.residents]
        self.cuda_stats.gpu_hits += len(resident)
        outputs = {}
        for expert in resident:  # GPU hits: computed at once
            key = (layer, expert)
            self.gpu.residents.touch(key)
            self.cache.touch_if_resident(
                key
            )  # keep the host copy warm, so a GPU eviction can fall back to it
            carry = None
            for index in range(len(self.stages)):
                carry = self._stage(_GpuOnly(layer), expert, index, hidden, routes[expert], carry)
            outputs[expert] = carry
            self._mark_used(key)
        if rest:
            job = self.cache.open_layer(layer, rest)
            self._prefetch(predicted)
            outputs.update(self._run(job, hidden, routes, rest))
        else:
            self._prefetch(predicted)
        return outputs

    def _prefetch(self, predicted: tuple[int, list[int]] | None) -> None:
        if predicted is not None:  # read ahead into the host tier only what the GPU tier lacks
            layer, experts = predicted
            self.cache.prefetch(layer, [e for e in experts if (layer, e) not in self.gpu.residents])

    def _prepare(self, job: LayerJob, expert: int, stage: int) -> bool:
        key = (job.layer, expert)
        state = self.gpu.slots.get(key)
        if state is None:
            if not self.gpu.victim_free(self._layer_keys):
                return False  # every GPU slot is held by this layer's unfinished experts
            state = self.gpu.admit(key, self._layer_keys)
            self.cuda_stats.gpu_misses += 1
        missing = [kind for kind in self.stages[stage] if kind not in state.copied]
        if missing:
            with torch.cuda.stream(self.copy_stream):
                for kind in missing:
                    self._copy(job, key, kind, state)
        for kind in self.stages[stage]:
            self._compute_stream.wait_event(state.copied[kind])
        return True

    def _copy(self, job: LayerJob, key: tuple[int, int], kind: str, state: GpuSlot) -> None:
        """Enqueue host slot -> GPU slot for one kind on the copy stream (current); record its event."""
        if state.last_use is not None:
            self.copy_stream.wait_event(state.last_use)
        host_state = self.cache.state_of(key)
        for (buffer, offset, part), (gpu_offset, ref) in zip(
            job.tensor_parts(key[1], kind), self.gpu.layouts[key][kind]
        ):
            src = self._views.bytes_of(buffer)[offset : offset + ref.nbytes]
            dst_start = state.slot * self.gpu.slot_bytes + gpu_offset
            self.gpu.buffer[dst_start : dst_start + ref.nbytes].copy_(src, non_blocking=True)
            self.cuda_stats.copy_bytes += ref.nbytes
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        state.copied[kind] = event
        self._note_host_use(host_state, event)

    def _finish(self, job: LayerJob, expert: int, failed: bool) -> None:
        key = (job.layer, expert)
        state = self.gpu.slots.get(key)
        if state is None:
            return
        state.pins -= 1
        if failed:
            self.gpu.residents.remove(key)
            del self.gpu.slots[key]
        else:
            self._mark_used(key)

    def _mark_used(self, key: tuple[int, int]) -> None:
        event = torch.cuda.Event()
        event.record(self._compute_stream)
        self.gpu.slots[key].last_use = event

    def _weight(self, job: Any, expert: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        key = (job.layer, expert)
        if kind == "gate_up" and self.emap.family == "swiglu":
            (gate_off, gate), (_, up) = self.gpu.layouts[key]["gate"][0], self.gpu.layouts[key]["up"][0]
            start = self.gpu.slots[key].slot * self.gpu.slot_bytes + gate_off
            raw = self.gpu.buffer[start : start + gate.nbytes + up.nbytes]
            weight = raw.view(TORCH_DTYPES[gate.dtype]).view(gate.shape[0] + up.shape[0], gate.shape[1])
            return weight if weight.dtype == dtype else weight.to(dtype)
        parts = []
        for offset, ref in self.gpu.layouts[key][kind]:
            start = self.gpu.slots[key].slot * self.gpu.slot_bytes + offset
            parts.append(
                self.gpu.buffer[start : start + ref.nbytes].view(TORCH_DTYPES[ref.dtype]).view(ref.shape)
            )
        return self._assemble(parts, dtype)


@dataclass
class _GpuOnly:
    """Stands in for a LayerJob when an expert is computed straight from the GPU tier."""

    layer: int


def register_pinned(buffer: AlignedBuffer, mapped: bool = False) -> None:
    """Page-lock an existing host allocation (cudaHostRegister) for asynchronous copies, or, `mapped`,
    for kernels to read it in place (cudaHostRegisterMapped)."""
    err = torch.cuda.cudart().cudaHostRegister(buffer.address, buffer.nbytes, 2 if mapped else 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {format_size(buffer.nbytes)} failed with CUDA error {int(err)}"
        )


class UnifiedExpertRuntime(_PinnedHostRuntime):
    """One tier for integrated GPUs (Jetson): pinned, device-mapped host slots that kernels read in place.

    O_DIRECT reads land in the slots; the GPU computes straight from them (no staging copy). A slot is
    refilled only after the kernels that read its previous expert are done (their event is waited for;
    the waits are counted in `host_syncs`).
    """

    def __init__(self, cache: ExpertCache, act_fn: Any, device: torch.device, **kwargs: Any) -> None:
        super().__init__(cache, act_fn, device, mapped=True, **kwargs)
        self._aliases = {id(buffer): device_alias(buffer, device) for buffer in self._registered}

    def _weight(self, job: LayerJob, expert: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        parts = []
        for buffer, offset, part in job.tensor_parts(expert, kind):
            raw = self._aliases[id(buffer)][offset : offset + part.ref.nbytes]
            parts.append(raw.view(TORCH_DTYPES[part.ref.dtype]).view(part.ref.shape))
        return self._assemble(parts, dtype)

    def _finish(self, job: LayerJob, expert: int, failed: bool) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._note_host_use(self.cache.state_of((job.layer, expert)), event)


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

"""Device tiers: where an expert's weights live when they are computed, and how they become usable.

The runtime schedules every layer the same way over a tier:
  * `split`: experts the tier can compute right now without the host cache (a GPU tier's residents);
    the rest go through the host cache, which delivers one readiness event per (expert, kind);
  * `prepare`: make a stage's kinds usable on the compute device (a GPU tier: admit a slot, copy on
    the copy stream, make the compute stream wait); False when it must wait for another expert;
  * `raws`: uint8 views of the parts of one kind where the kernels read them (no copy);
  * `release`: the expert's last stage has been issued;
  * `abort`: the forward raised somewhere; whatever it holds is given back.
`HostTier` computes straight from the host cache's slots (CPU); the CUDA tiers are in `runtime.cuda`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from moestream.cache.expert_cache import ExpertCache
from moestream.cache.records import LayerJob
from moestream.runtime.weights import SlotTensors
from moestream.units import format_size


@dataclass
class TierStats:
    gpu_hits: int = 0  # experts computed from the tier without the host cache
    gpu_misses: int = 0  # experts copied into the tier
    copy_bytes: int = 0
    host_syncs: int = 0  # waits on the device before a host slot could be refilled


class DeviceTier(ABC):
    """What every tier implements; the defaults are the host tier's (no faster tier, nothing to copy)."""

    fuses = False  # lays out a family's fusions back to back, so they are computed as one matrix
    gpu_bytes = 0  # device memory the tier holds (GPU slots)
    in_place = True  # kernels read the host cache's slots where they are (`prepare` copies nothing)

    def __init__(self, cache: ExpertCache, device: torch.device | None = None) -> None:
        self.cache = cache
        self.device = device if device is not None else torch.device("cpu")  # where kernels read weights
        self.stats = TierStats()
        self._views = SlotTensors()

    def begin_group(self, layer: int, order: list[int], uses: list[int], tokens: int) -> None:
        """A layer forward over `order` starts (before `split`): a tier with its own eviction policy
        tells it (`ResidentSet.begin_group`); `uses[i]` of the `tokens` are routed to `order[i]`."""

    def split(self, layer: int, order: list[int]) -> tuple[list[int], list[int]]:
        """(experts usable now without the host cache, the rest), both in execution order."""
        return [], order

    def missing(self, layer: int, experts: list[int]) -> list[int]:
        """Which of `experts` this tier does not hold (what a prefetch should read)."""
        return experts

    def prepare(self, job: LayerJob, expert: int, kinds: tuple[str, ...]) -> bool:
        """Make `kinds` of `expert` usable by the next kernels; False: wait for another expert first."""
        return True

    @abstractmethod
    def raws(self, layer: int, expert: int, kind: str, job: LayerJob | None) -> list[torch.Tensor]:
        """uint8 tensors over each part of `kind` (a fusion name when `fuses`), where kernels read them."""

    def release(self, layer: int, expert: int, job: LayerJob | None, failed: bool) -> None:
        """The expert's last stage has been issued (or the forward failed)."""

    def abort(self, layer: int) -> None:
        """The forward of `layer` raised: give back everything it holds in this tier."""

    @abstractmethod
    def describe(self) -> str:
        """The memory part of the mode line."""

    def close(self) -> None:
        """Give back what the tier holds (device memory, page-locking)."""


class HostTier(DeviceTier):
    """Experts computed on the CPU straight from the host cache's slots."""

    def raws(self, layer: int, expert: int, kind: str, job: LayerJob | None) -> list[torch.Tensor]:
        return [
            self._views.bytes_of(buffer)[offset : offset + part.ref.nbytes]
            for buffer, offset, part in job.tensor_parts(expert, kind)
        ]

    def describe(self) -> str:
        c = self.cache
        return (
            f"cache {format_size(c.budget_bytes)} = {c.capacity} slots of {format_size(c.slot_bytes)} "
            f"({'locked' if c.locked else 'unlocked'})"
        )

"""`--parallel auto` on a ggml backend (ggml's CUDA; its CPU backend through the same path in the tests).

There each KV-cache slot and the graphs' buffers live in the device's memory, beside the trunk and the
routed experts (every one in stacks, or a GPU tier): the slots are chosen by the device's free memory, with
the very numbers the runner then sizes its tier from (`ggml_runner.device_needs`, `gpu_tier.auto_tier`):

- `--gpu-tier auto`: N slots where, their KV cache and graph buffers kept, every expert still goes on the
  device if it did with one slot; else where N slots' tier keeps at least (KEEP_SHARE - 1) / KEEP_SHARE
  (7/8) of one slot's tier bytes;
- an explicit `--gpu-tier SIZE` (or none: every expert on the device): N slots where what the device
  leaves after the trunk, their KV cache and graph buffers and the margin (`gpu_tier.tier_room`) still
  holds the tier.

The host's plan (`auto_budget.auto_parallel`, the expert cache in RAM beside each slot's host-side KV
rows) chose first: the device chooses among the slots it allowed. The largest allowed of
PARALLEL_CHOICES wins; the words say the choice and why.
"""

from __future__ import annotations

from typing import Any

from moestream.engine.auto_budget import KEEP_SHARE, PARALLEL_CHOICES, keeps_share
from moestream.engine.ggml_runner import DeviceNeeds, device_needs
from moestream.engine.gpu_tier import auto_tier, tier_room
from moestream.engine.options import AUTO
from moestream.errors import CacheBudgetError
from moestream.runtime.expert_layers import ExpertLayers
from moestream.units import format_size


def device_parallel(
    memory: Any,
    spec: Any,
    experts: ExpertLayers,
    ctx_size: int,
    threads: int,
    trunk_bytes: int,
    gpu_tier: int | str | None,
    most: int,
) -> tuple[int, str]:
    """--parallel auto for the ggml runner of `spec` on `memory`'s backend (a `DeviceMemory`: its free
    memory before the trunk was copied there, `before`; the streaming built: `experts`; the trunk
    `trunk_bytes`; `gpu_tier` as the runner gets it), at most `most` slots (the host's choice): (slots,
    the mode line's words why). 1 where the backend does not say its free memory."""
    backend = memory.backend
    where = "the GPU" if backend.kind == "cuda" else f"ggml's {backend.kind} backend"
    free, total = memory.before
    if not total:
        return 1, f"ggml's {backend.kind} backend does not say its free memory (give -np N)"
    needs = {}
    for n in (n for n in PARALLEL_CHOICES if n <= most or n == 1):
        need = device_needs(spec, experts, ctx_size, threads, n, trunk_bytes)
        if need is None:
            return 1, f"the experts are not in slots the graphs address on {where} (give -np N)"
        needs[n] = need
    return choose_device_slots(free, needs, gpu_tier, ctx_size, where)


def choose_device_slots(
    free: int, needs: dict[int, DeviceNeeds], gpu_tier: int | str | None, tokens: int, where: str
) -> tuple[int, str]:
    """The rule (module doc) over `needs` (one for each N to choose from, 1 among them) on a device with
    `free` bytes free: (the largest N allowed, the words). One slot is always allowed (the runner says
    where even one does not fit). `tokens`: each slot's context, `where`: the device, for the words."""
    one = needs[1]
    refused: list[str] = []
    for n in sorted(needs, reverse=True):
        if n == 1:
            break
        ok, why = (_auto if gpu_tier == AUTO else _given)(free, needs[n], one, gpu_tier, where)
        if ok:
            words = f"{n} KV slots of {tokens} tokens (F16) on {where}, {format_size(needs[n].kv)}; {why}"
            return n, words + "".join(f"; {r}" for r in refused)
        refused.append(why)
    return 1, "; ".join(refused) or "one slot"


def _tier(free: int, need: DeviceNeeds) -> int | None:
    """`auto_tier`'s choice with `need`'s reserve: None (every expert on the device), else the tier's
    bytes (0: too little left for one)."""
    try:
        return auto_tier(free, need.reserve, need.every, need.least, need.holds_all)
    except CacheBudgetError:
        return 0


def _auto(free: int, need: DeviceNeeds, one: DeviceNeeds, gpu_tier: Any, where: str) -> tuple[bool, str]:
    """--gpu-tier auto: (allowed, the words of the choice or of the refusal)."""
    n, mine, ones = need.slots, _tier(free, need), _tier(free, one)
    if ones is None:
        if mine is None:
            return True, f"every expert still on {where}"
        left = f"a tier of {format_size(mine)}" if mine else "no room for a tier"
        return False, f"{n} slots would leave {where} {left}, not every expert's {format_size(need.every)}"
    if mine and keeps_share(mine, ones):
        return True, f"the GPU tier keeps {format_size(mine)} of one slot's {format_size(ones)}"
    return False, (
        f"{n} slots would leave the GPU tier {format_size(mine or 0)} of one slot's {format_size(ones)} "
        f"(less than {KEEP_SHARE - 1}/{KEEP_SHARE})"
    )


def _given(free: int, need: DeviceNeeds, one: DeviceNeeds, gpu_tier: Any, where: str) -> tuple[bool, str]:
    """An explicit --gpu-tier (None: every expert on the device): (allowed, the words)."""
    tier = need.every if gpu_tier is None else min(int(gpu_tier), need.every)
    beside = f"every expert on {where}" if gpu_tier is None else f"the GPU tier of {format_size(tier)}"
    if tier_room(free, need.reserve) >= tier:
        return True, f"they fit beside {beside}"
    return False, (
        f"{need.slots} slots' {format_size(need.kv)} KV cache and {format_size(need.graphs)} of graph "
        f"buffers would not fit on {where} ({format_size(free)} free) beside {beside}"
    )

"""`auto` budgets: the expert cache sized from the machine's memory at load, every expert when all fit.

An auto budget is sized after the trunk is read (on a GPU, moved there; on a ggml backend, copied there
and its host copy given back but the routers', `engine/trunk_release.py`) and before the cache is
allocated, so the room (`memory_rooms`: every memory cgroup's limit less its unreclaimable usage, and
MemAvailable) is measured with the trunk already in it. What the room must still keep besides the cache:

- the KV cache at the full context (the ggml runner's F16 tensors, else transformers' in the model's
  dtype), allocated after the cache;
- the ggml runner's graph buffers: laid out before they exist (`ggml_runner.planned_bytes`); under
  transformers (the eager trunk), which prefills a prompt whole, a full-context prefill's activations;
- the pages of the files the process has mapped and touched, its libraries (torch, ggml, the
  tokenizer's), measured as RssFile in /proc/self/status: the cgroup's usage and MemAvailable count
  them as page cache that can be given back, but the process runs from them, and reclaimed they are
  read again on every call into them;
- working memory (WORKING_BYTES: torch's glue between graphs, the tokenizer, the allocator's slack);
- a margin of 1/MARGIN_SHARE of the room: what the kernel charges besides the process's pages (the page
  tables of a locked cache, slab) and the arenas glibc gives each I/O and compute thread.

On CUDA the GPU tier is sized from the free VRAM (`torch.cuda.mem_get_info`, the trunk already there)
less the KV cache and the activations, and the pinned host tier from RAM (none when the GPU tier holds
every expert); unified memory (one tier of host memory the GPU reads in place) is one budget from RAM
that also keeps the KV cache and the activations. An explicit size wins over auto, tier by tier.

`--parallel auto` (serve's default) is chosen here too, before the cache is sized: the largest of
PARALLEL_CHOICES slots that the runner can batch and the memory plan affords (`choose_parallel`); on a
ggml backend, where the slots' KV cache and graph buffers also take the device's memory, the device then
chooses among those (`engine/device_parallel.py`, once the streaming is built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moestream.cache.size_classes import budget_requirements, planned_bytes
from moestream.engine.memory import (
    WORKING_BYTES,
    MemoryNeed,
    Room,
    check_memory,
    lock_allowed,
    memlock_room,
    memory_rooms,
    process_status,
)
from moestream.engine.model_description import ModelDescription
from moestream.engine.options import AUTO, EngineOptions
from moestream.errors import MemoryBudgetError
from moestream.model.arch import text_config
from moestream.units import format_size

MARGIN_SHARE = 32  # 1/32 of the room is left unused (see the module's docstring)
GPU_RESERVE = 512 << 20  # CUDA: cuBLAS workspaces, the caching allocator's blocks, CUDA graphs' pools
_EVERY = 1 << 62  # a budget past any checkpoint: `planned_bytes` of it is every expert's slots
PARALLEL_CHOICES = (4, 2, 1)  # what --parallel auto chooses from, largest first
KEEP_SHARE = 8  # --parallel auto: N slots must leave a streaming cache at least 7/8 of one slot's bytes


@dataclass(frozen=True)
class AutoBudget:
    """One tier's auto budget: the bytes chosen, from which limit, and what that limit had to keep."""

    tier: str  # "cache", "GPU tier", "host tier", "unified memory cache"
    nbytes: int  # the budget chosen (0: the tier is not used)
    every: int  # the budget that holds every expert
    room: Room  # the tightest limit, as measured when the budget was chosen
    kept: tuple[tuple[str, int], ...]  # what the room keeps besides the tier, margin included

    @property
    def holds_all(self) -> bool:
        return self.nbytes >= self.every

    def describe(self) -> str:
        """The mode line's account of the choice: what, and from which limit."""
        limit = f"tightest limit: {self.room.why}"
        if self.holds_all:
            return f"auto {self.tier}: every expert, nothing streamed ({format_size(self.every)}; {limit})"
        if self.nbytes == 0:
            return f"auto {self.tier}: none, staging slots only ({limit})"
        kept = " + ".join(f"{name} {format_size(n)}" for name, n in self.kept if n)
        return (
            f"auto {self.tier}: the largest that fits ({limit}; {format_size(self.room.nbytes)} left, "
            f"less {kept})"
        )


def largest_fit(
    tier: str,
    room: Room,
    kept: list[tuple[str, int]],
    every: int,
    minimum: int,
    allocated: Callable[[int], int] = lambda budget: budget,
) -> AutoBudget:
    """The largest budget, at most `every`, whose allocation (`allocated(budget)`) fits `room` after
    `kept` and the margin.

    Raises:
        MemoryBudgetError: not even `minimum` fits (the parts, the limit and the minimum named).
    """
    kept = [*kept, (f"a margin of 1/{MARGIN_SHARE}", max(room.nbytes, 0) // MARGIN_SHARE)]
    free = room.nbytes - sum(n for _, n in kept)
    smallest = f"the {tier} at its smallest"
    check_memory(MemoryNeed([(smallest, allocated(minimum)), *kept]), [room], smallest, minimum=minimum)
    budget = min(every, free)
    while budget > minimum and allocated(budget) > free:  # size classes round up to top-k slots each
        budget = max(minimum, budget - (allocated(budget) - free))
    return AutoBudget(tier, budget, every, room, tuple(kept))


def cuda_split(
    gpu_room: Room,
    gpu_kept: list[tuple[str, int]],
    gpu_every: int,
    gpu_minimum: int,
    host_room: Room,
    host_kept: list[tuple[str, int]],
    host_every: int,
    host_minimum: int,
    gpu_given: int | None = None,
) -> tuple[AutoBudget, AutoBudget]:
    """(GPU tier, pinned host tier): the GPU tier `gpu_given`, or the largest that free VRAM leaves
    after `gpu_kept`; the host tier none (0: staging only) when the GPU tier holds every expert or RAM
    has no room past the staging slots, else the largest that RAM leaves after `host_kept`.

    Raises:
        MemoryBudgetError: the GPU has no room for its smallest tier (top-k slots).
    """
    if gpu_given is None:
        gpu = largest_fit("GPU tier", gpu_room, gpu_kept, gpu_every, gpu_minimum)
    else:
        gpu = AutoBudget("GPU tier", gpu_given, gpu_every, gpu_room, ())
    host_kept = [*host_kept, (f"a margin of 1/{MARGIN_SHARE}", max(host_room.nbytes, 0) // MARGIN_SHARE)]
    free = host_room.nbytes - sum(n for _, n in host_kept)
    host = 0 if gpu.holds_all or free < host_minimum else min(host_every, free)
    return gpu, AutoBudget("host tier", host, host_every, host_room, tuple(host_kept))


def mapped_file_bytes(root: Path = Path("/")) -> int:
    """Resident pages of the files the process maps (RssFile): its libraries, measured."""
    return int(process_status(root).get("RssFile", "0 kB").split()[0]) * 1024


def size_auto(model: ModelDescription, options: EngineOptions) -> tuple[EngineOptions, list[AutoBudget]]:
    """`options` with every auto budget sized for the loaded `model` (its trunk read, its family made:
    the description made after the build; unlocked where RLIMIT_MEMLOCK forbids locking what was
    chosen), and the budgets' accounts for the mode line; unchanged (and no accounts) without auto.

    Raises:
        MemoryBudgetError: the machine has no room for the smallest cache.
    """
    if not options.auto:
        return options, []
    sized, accounts = _size(model, options)
    return _lock_check(model, sized), accounts


def _size(model: ModelDescription, options: EngineOptions) -> tuple[EngineOptions, list[AutoBudget]]:
    emap, top_k = model.emap, model.top_k
    host_every = planned_bytes(emap, _EVERY, top_k)
    host_minimum = budget_requirements(emap, top_k)[0]
    fit = lambda budget: planned_bytes(emap, budget, top_k)  # noqa: E731
    libraries = [("the libraries' mapped files", mapped_file_bytes()), ("working memory", WORKING_BYTES)]
    # the tightest limit; where none could be read, nothing bounds the cache but the experts
    room = min(memory_rooms(), key=lambda r: r.nbytes, default=Room(_EVERY, "no memory limit could be read"))
    kv = (f"the KV cache at {model.ctx_size} tokens", model.kv_bytes)
    one_tier = model.device.type != "cuda"
    if not one_tier:
        from moestream.runtime.streaming import uses_unified_memory

        activations = ("activations", activation_bytes(model.config, model.ctx_size))
        if not uses_unified_memory(options.unified, model.device):
            return _size_cuda(model, options, room, [kv, activations], libraries)
    if options.cache != AUTO:  # an explicit size wins (the CUDA tier sizes do not apply to one tier)
        return dataclasses.replace(options, gpu_cache=options.cache, host_cache=0), []
    if one_tier:
        cache = largest_fit(
            "cache", room, [*_runner_parts(model, kv, options), *libraries], host_every, host_minimum, fit
        )
    else:  # unified memory: the KV cache and the activations are in the same memory as the cache
        kept = [kv, activations, *libraries]
        cache = largest_fit("unified memory cache", room, kept, host_every, host_minimum, fit)
    return dataclasses.replace(options, cache=cache.nbytes, gpu_cache=cache.nbytes, host_cache=0), [cache]


def _size_cuda(
    model: ModelDescription,
    options: EngineOptions,
    host_room: Room,
    gpu_kept: list[tuple[str, int]],
    host_kept: list[tuple[str, int]],
) -> tuple[EngineOptions, list[AutoBudget]]:
    """The GPU and host tiers (those asked to be auto) for a GPU-slot device."""
    import torch

    from moestream.runtime.cuda import gpu_layout

    emap, top_k = model.emap, model.top_k
    slot = max(gpu_layout(emap, key, model.fusions)[1] for key in emap.units)
    free, total = torch.cuda.mem_get_info(model.device)
    gpu_room = Room(free, f"{format_size(free)} of the GPU's {format_size(total)} free")
    gpu_auto = options.gpu_cache == AUTO
    gpu, host = cuda_split(
        gpu_room,
        [*gpu_kept, ("CUDA workspaces", GPU_RESERVE)],
        slot * len(emap.units),
        slot * top_k,
        host_room,
        host_kept,
        planned_bytes(emap, _EVERY, top_k),
        budget_requirements(emap, top_k)[0],
        gpu_given=None if gpu_auto else options.gpu_cache,
    )
    host_auto = options.host_cache == AUTO
    accounts = [tier for tier, auto in ((gpu, gpu_auto), (host, host_auto)) if auto]
    host_cache = host.nbytes if host_auto else options.host_cache
    sized = dataclasses.replace(options, cache=gpu.nbytes, gpu_cache=gpu.nbytes, host_cache=host_cache)
    return sized, accounts


def _runner_parts(
    model: ModelDescription, kv: tuple[str, int], options: EngineOptions | None = None
) -> list[tuple[str, int]]:
    """What the CPU trunk takes after the cache: the KV cache and the ggml graphs' buffers, or, under
    transformers (which prefills a prompt whole), the KV cache and a full-context prefill's activations.
    On ggml's CUDA backend (`options.ggml_device`) the graphs' KV cache is the GPU's: none of it here; nor
    their buffers where a GPU tier's misses are copied to it and computed there (`tier_misses`: upload,
    the default; the CPU's graphs of the other ways are kept at the runner's plan); nor the routers'
    float32 copies, given back with the trunk's host copy (`engine/trunk_release.py`; the room is measured
    after that, the trunk's bytes in it)."""
    if model.spec is None:
        return [kv, ("activations", activation_bytes(model.config, model.ctx_size))]
    from moestream.engine.ggml_runner import planned_bytes as runner_bytes
    from moestream.model.arch import num_experts

    cfg = text_config(model.config)
    inter = int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    experts = num_experts(model.config)
    slots = model.parallel
    kv_bytes, graphs = runner_bytes(model.spec, model.ctx_size, experts, inter, model.threads, slots)
    each = f" in each of {slots} slots" if slots > 1 else ""
    on_gpu = options is not None and options.ggml_device is not None
    if on_gpu:
        kv_bytes = 0  # (the runner's host tensors only name the device's copies: never written)
        from moestream.engine.tiered_steps import tier_misses

        if tier_misses(True) == "upload":
            graphs = 0  # the graph sets' scratch is a buffer of the GPU (`Arena` on a backend)
    parts = [
        (f"the F16 KV cache at {model.ctx_size} tokens{each}", kv_bytes),
        ("the ggml graphs' buffers", graphs),
    ]
    if model.spec.copied_bytes and not on_gpu:
        parts.append(("the routers in float32", model.spec.copied_bytes))
    from moestream.ggml.repack import REPACK_ENV, repack_wanted

    if repack_wanted():
        from moestream.engine.repacked import copy_bytes

        parts.append((f"the repacked copies ({REPACK_ENV}=1)", copy_bytes(model.emap, model.spec)))
    return parts


def activation_bytes(config: Any, ctx_size: int) -> int:
    """Under transformers, a prefill of the whole context at once (it does not chunk one), f32: per token
    16 hidden-size vectors (residual, norms, q/k/v/o, the experts' summed output) and, per routed expert,
    its gate, up and product (3 intermediate-size vectors). An upper bound: 200 KiB a token for
    Qwen3-30B-A3B's sizes, where a 2000-token prompt through the eager CPU path peaked 110 KiB a token
    above the loaded engine."""
    cfg = text_config(config)
    hidden = int(cfg.hidden_size)
    inter = int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    k = int(getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "experts_per_token", 1))
    return 4 * ctx_size * (16 * hidden + 3 * k * inter)


def _lock_check(model: ModelDescription, options: EngineOptions) -> EngineOptions:
    """As `plan_memory`'s lock check, for the host slots the budget was sized to: unlocked (said once)
    where RLIMIT_MEMLOCK forbids locking them."""
    from moestream.runtime.streaming import host_cache_bytes

    if not options.lock_memory:
        return options
    host = host_cache_bytes(model.emap, options.stream_config(), model.top_k, model.device)
    if lock_allowed(MemoryNeed([("the expert cache", host)], locked=host), memlock_room()):
        return options
    return dataclasses.replace(options, lock_memory=False)


# --- --parallel auto ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotPlan:
    """The memory plan with `slots` KV-cache slots: what they take, and what they leave the cache."""

    slots: int
    kv: int  # the KV cache of every slot (the ggml runner's F16 tensors)
    extra: int  # bytes these slots take beyond one slot's plan (KV slots + graph buffers)
    kept: int = 0  # what the room keeps besides the cache and the margin (KV, graphs, libraries, working)
    cache: int | None = None  # an auto cache: its bytes with these slots (None: not even its smallest)
    fits: bool = True  # an explicit cache: the plan with these slots passes the memory check


def choose_parallel(plans: Sequence[SlotPlan], every: int | None, tokens: int) -> tuple[SlotPlan, str]:
    """`--parallel auto`'s rule: of `plans` (one for each N of PARALLEL_CHOICES, one slot among them),
    the largest N whose extra slots do not take the experts' memory, and the words saying why.

    - An auto cache (`every`: the bytes that hold every expert): where one slot's cache holds every
      expert, N slots' must still hold every expert; where it streams, N slots' must keep at least
      (KEEP_SHARE - 1) / KEEP_SHARE (7/8) of one slot's bytes.
    - An explicit cache (`every` None): N slots' plan must pass the memory check (`fits`).

    One slot is always allowed (the plan for one slot was checked at load already). `tokens`: each
    slot's context, for the words.
    """
    plans = sorted(plans, key=lambda p: -p.slots)
    one = next(p for p in plans if p.slots == 1)
    refused: list[str] = []
    for plan in plans:
        if plan.slots == 1:
            break
        if every is None:
            ok = plan.fits
            why = "" if ok else f"{plan.slots} slots' {format_size(plan.kv)} KV cache would not fit"
        else:
            ok, why = _keeps_cache(plan, one, every)
        if ok:
            words = f"{plan.slots} KV slots of {tokens} tokens (F16), {format_size(plan.kv)}; "
            if every is None:
                words += "they fit beside the cache given"
            elif one.cache is not None and one.cache >= every:
                words += "every expert still cached"
            else:
                kept = f"{format_size(plan.cache or 0)} of one slot's {format_size(one.cache or 0)}"
                words += f"the cache keeps {kept}"
            return plan, words + "".join(f"; {r}" for r in refused)
        refused.append(why)
    return one, "; ".join(refused) or "one slot"


def keeps_share(mine: int, ones: int) -> bool:
    """Whether N slots' budget `mine` keeps at least (KEEP_SHARE - 1) / KEEP_SHARE of one slot's `ones`
    (`--parallel auto`'s rule, for the host's cache and for a device's GPU tier)."""
    return mine * KEEP_SHARE >= ones * (KEEP_SHARE - 1)


def _keeps_cache(plan: SlotPlan, one: SlotPlan, every: int) -> tuple[bool, str]:
    """Whether an auto cache with `plan`'s slots keeps what one slot's has (`choose_parallel`'s rule)."""
    if plan.cache is None or one.cache is None:
        return False, f"{plan.slots} slots would leave no room for the cache"
    if one.cache >= every:
        if plan.cache >= every:
            return True, ""
        return False, (
            f"{plan.slots} slots would leave the cache {format_size(plan.cache)} of every expert's "
            f"{format_size(every)}"
        )
    if keeps_share(plan.cache, one.cache):
        return True, ""
    return False, (
        f"{plan.slots} slots would leave the cache {format_size(plan.cache)} of one slot's "
        f"{format_size(one.cache)} (less than {KEEP_SHARE - 1}/{KEEP_SHARE})"
    )


def no_batching(model: ModelDescription, options: EngineOptions, no_graph: str | None) -> str | None:
    """Why this run's runner decodes one sequence at a time (None: the ggml graphs, which batch several,
    on the CPU or on a backend): the words after "auto: " in the mode line."""
    if model.spec is None:
        if model.device.type != "cpu":
            why = f"--device {model.device.type}"
        else:
            why = f"transformers: {no_graph}" if no_graph else f"--trunk {options.trunk}"
        return f"this run's trunk ({why}) runs one request at a time"
    if any(layer.mixer.recurrent for layer in model.spec.layers):
        return f"{model.spec.family}'s linear-attention layers keep one recurrent state"
    return None


def auto_parallel(
    model: ModelDescription,
    options: EngineOptions,
    no_graph: str | None = None,
    rooms: list[Room] | None = None,
) -> tuple[int, str]:
    """--parallel auto for the loaded `model` (its trunk in, `model.spec` set; `model.parallel` 1):
    (slots, the mode line's words why), by `choose_parallel` over `slot_plans`: the host's memory plan.
    1 where the runner cannot batch (`no_batching`). On a ggml backend the device's memory then chooses
    among the slots allowed here (`engine/device_parallel.py`)."""
    unbatched = no_batching(model, options, no_graph)
    if unbatched is not None:
        return 1, unbatched
    plans, every = slot_plans(model, options, rooms)
    chosen, words = choose_parallel(plans, every, model.ctx_size)
    return chosen.slots, words


def slot_plans(
    model: ModelDescription, options: EngineOptions, rooms: list[Room] | None = None
) -> tuple[list[SlotPlan], int | None]:
    """The memory plan of each of PARALLEL_CHOICES slots for the ggml runner of `model` against the
    tightest of `rooms` (default: `memory_rooms()`, measured now), and the bytes of every expert (None:
    an explicit cache). Each plan keeps what `size_auto` keeps besides the cache: the runner's KV cache
    and graph buffers for those slots (`_runner_parts`), the libraries' mapped files, working memory
    and the margin. An auto cache: what `largest_fit` gives it then; an explicit one: whether
    `check_memory` passes with it."""
    if rooms is None:
        rooms = memory_rooms()
    room = min(rooms, key=lambda r: r.nbytes, default=Room(_EVERY, "no memory limit could be read"))
    libraries = [("the libraries' mapped files", mapped_file_bytes()), ("working memory", WORKING_BYTES)]
    kv = (f"the KV cache at {model.ctx_size} tokens", model.kv_bytes)
    emap, top_k = model.emap, model.top_k
    every = planned_bytes(emap, _EVERY, top_k) if options.cache == AUTO else None
    fit = lambda budget: planned_bytes(emap, budget, top_k)  # noqa: E731
    minimum = budget_requirements(emap, top_k)[0]
    parts = {n: _runner_parts(dataclasses.replace(model, parallel=n), kv, options) for n in PARALLEL_CHOICES}
    host = 0
    if every is None:
        from moestream.runtime.streaming import host_cache_bytes

        given = dataclasses.replace(options, gpu_cache=options.cache, host_cache=0)  # as `_size`
        host = host_cache_bytes(emap, given.stream_config(), top_k, model.device)
    plans = []
    for n, kept in parts.items():
        extra = sum(b for _, b in kept) - sum(b for _, b in parts[1])
        plan = SlotPlan(n, kept[0][1], extra, sum(b for _, b in [*kept, *libraries]))
        if every is not None:
            try:
                cache = largest_fit("cache", room, [*kept, *libraries], every, minimum, fit).nbytes
            except MemoryBudgetError:
                cache = None
            plan = dataclasses.replace(plan, cache=cache)
        else:
            margin = (f"a margin of 1/{MARGIN_SHARE}", max(room.nbytes, 0) // MARGIN_SHARE)
            try:
                check_memory(MemoryNeed([("the expert cache", host), *kept, *libraries, margin]), [room])
            except MemoryBudgetError:
                plan = dataclasses.replace(plan, fits=False)
        plans.append(plan)
    return plans, every

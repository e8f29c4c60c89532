"""The mode line: what a loaded model runs (model, device, experts and their formats, cache, budgets,
threads, dtype, trunk, GPU floor, context), printed at the start of every run so nobody benchmarks the
wrong thing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moestream.engine.memory import storage_ranges
from moestream.runtime.formats import describe_formats
from moestream.units import format_size


def describe(loaded: Any, notes: Sequence[str] = ()) -> str:
    """What `loaded` (a `LoadedModel`) runs, printed at the start of every run so nobody benchmarks the
    wrong thing; `notes` (the `Engine`'s: a routing replay) after the GPU floor's part."""
    return (
        f"moestream: {loaded.config.model_type} on {_device(loaded)} | {loaded.streaming.describe()} of "
        f"{len(loaded.emap.units)} experts ({format_size(loaded.emap.expert_bytes)}, "
        f"{describe_formats(loaded.runtime.formats)}) | "
        + "".join(f"{budget.describe()} | " for budget in loaded.auto)
        + f"{_threads_part(loaded)} | dtype {str(loaded.dtype).removeprefix('torch.')} | "
        f"{_trunk_part(loaded)}{loaded.trunk_line} | "
        f"{loaded.floor.describe() if loaded.floor is not None else 'gpu floor off'}"
        + "".join(f" | {note}" for note in notes)
        + (
            f" | LOSSY: {loaded.top_k} experts per token instead of the model's {loaded.model_top_k}"
            if loaded.top_k != loaded.model_top_k
            else ""
        )
        + f" | {loaded.context_line()}"
    )


def _device(loaded: Any) -> str:
    """The device asked for: --device cuda on ggml's CUDA backend is that GPU, torch's device the CPU."""
    return loaded.options.ggml_device or str(loaded.device)


def _threads_part(loaded: Any) -> str:
    if loaded.runner.owns_compute_pool:
        return f"threads {loaded.threads} (one ggml pool; torch 1)"
    return f"threads {torch.get_num_threads()}"


def _trunk_part(loaded: Any) -> str:
    """The trunk in host memory (read into memory the process owns, not mapped; on a ggml backend copied
    there at load and its host copy given back but the routers'), and on a GPU what moestream holds in
    GPU memory: the trunk, the GPU tier, the KV cache when full."""
    blocks = loaded.trunk_blocks
    kept = f", {format_size(blocks)} of it in GGUF block types" if blocks else ""
    text = ""
    if loaded.trunk.nbytes:
        lock = "locked" if loaded.trunk.locked else "unlocked"
        where = kept if loaded.device.type == "cpu" else ""
        text = f"trunk {format_size(loaded.trunk.nbytes)} ({lock}{where})"
        on = loaded.trunk_device
        if on is not None:
            text += (
                f" on ggml's {on.kind} backend, {format_size(on.released)} of its host copy given back "
                f"(the routers' {format_size(on.kept)} kept)"
            )
        text += " | "
    if loaded.device.type != "cuda":
        return text
    trunk = sum(storage_ranges(loaded.model, "cuda").values())
    tier = loaded.runtime.tier.gpu_bytes
    kv = loaded.kv_bytes
    return text + (
        f"GPU memory {format_size(trunk + tier + kv)}: trunk {format_size(trunk)}{kept} + GPU tier "
        f"{format_size(tier)} + KV cache {format_size(kv)} at {loaded.ctx_size} tokens | "
    )

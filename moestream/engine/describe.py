"""The mode line: what a loaded engine runs (model, device, experts and their formats, cache, budgets,
threads, dtype, trunk, GPU floor, context), printed at the start of every run so nobody benchmarks the
wrong thing."""

from __future__ import annotations

from typing import Any

import torch

from moestream.engine.memory import storage_ranges
from moestream.model.quantized import block_bytes
from moestream.runtime.formats import describe_formats
from moestream.units import format_size


def describe(engine: Any) -> str:
    """What is being run, printed at the start of every run so nobody benchmarks the wrong thing."""
    return (
        f"moestream: {engine.config.model_type} on {engine.device} | {engine.streaming.describe()} of "
        f"{len(engine.emap.units)} experts ({format_size(engine.emap.expert_bytes)}, "
        f"{describe_formats(engine.runtime.formats)}) | "
        + "".join(f"{budget.describe()} | " for budget in engine.auto)
        + f"{_threads_part(engine)} | dtype {str(engine.dtype).removeprefix('torch.')} | "
        f"{_trunk_part(engine)}{engine.trunk_line} | "
        f"{engine.floor.describe() if engine.floor is not None else 'gpu floor off'}"
        + (
            f" | ROUTING REPLAYED from {engine.replay.name} (benchmark only: outputs are not the model's)"
            if engine.replay is not None
            else ""
        )
        + (
            f" | LOSSY: {engine.top_k} experts per token instead of the model's {engine.model_top_k}"
            if engine.top_k != engine.model_top_k
            else ""
        )
        + f" | {engine.context_line()}"
    )


def _threads_part(engine: Any) -> str:
    if engine.runner.owns_compute_pool:
        return f"threads {engine.threads} (one ggml pool; torch 1)"
    return f"threads {torch.get_num_threads()}"


def _trunk_part(engine: Any) -> str:
    """The trunk in host memory (read into memory the process owns, not mapped), and on a GPU what
    moestream holds in GPU memory: the trunk, the GPU tier, the KV cache when full."""
    blocks = block_bytes(engine.model)
    kept = f", {format_size(blocks)} of it in GGUF block types" if blocks else ""
    text = ""
    if engine.trunk.nbytes:
        lock = "locked" if engine.trunk.locked else "unlocked"
        where = kept if engine.device.type == "cpu" else ""
        text = f"trunk {format_size(engine.trunk.nbytes)} ({lock}{where}) | "
    if engine.device.type != "cuda":
        return text
    trunk = sum(storage_ranges(engine.model, "cuda").values())
    tier = engine.runtime.tier.gpu_bytes
    kv = engine._kv_bytes()
    return text + (
        f"GPU memory {format_size(trunk + tier + kv)}: trunk {format_size(trunk)}{kept} + GPU tier "
        f"{format_size(tier)} + KV cache {format_size(kv)} at {engine.ctx_size} tokens | "
    )

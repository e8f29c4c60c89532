"""Building the expert cache and runtime for the engine's device (CPU, or CUDA with a GPU tier)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers.activations import ACT2FN

from moestream.cache.expert_cache import ExpertCache, budget_requirements
from moestream.cache.policy import EvictionPolicy, LFUPolicy, LRUPolicy
from moestream.engine.options import EngineOptions
from moestream.io.reader import Reader
from moestream.model.arch import text_config
from moestream.runtime.experts import ExpertRuntime, GptOssParams
from moestream.runtime.weights import TORCH_DTYPES
from moestream.store.experts import ExpertMap
from moestream.units import format_size


POLICY_CLASSES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def build_runtime(
    emap: ExpertMap,
    reader: Reader,
    options: EngineOptions,
    config: Any,
    top_k: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[ExpertCache, ExpertRuntime]:
    """The host expert cache and the runtime computing experts on `device`."""
    kwargs = _math_kwargs(emap, config, device, dtype)
    policy = POLICY_CLASSES[options.policy]
    if device.type != "cuda":
        cache = ExpertCache(
            emap,
            options.cache,
            reader,
            top_k=top_k,
            piece_bytes=options.piece,
            lock_memory=options.lock_memory,
            policy_factory=policy,
        )
        return cache, ExpertRuntime(cache, kwargs.pop("act_fn"), **kwargs)
    from moestream.runtime.cuda import CudaExpertRuntime, GpuTier, UnifiedExpertRuntime

    if uses_unified_memory(options, device):
        cache = ExpertCache(
            emap,
            options.cache,
            reader,
            top_k=top_k,
            piece_bytes=options.piece,
            lock_memory=options.lock_memory,
            policy_factory=policy,
        )
        return cache, UnifiedExpertRuntime(cache, kwargs.pop("act_fn"), device, **kwargs)
    minimum, working_set = budget_requirements(emap, top_k)
    # pinned host tier between disk and GPU; 0 means staging only: one layer's worst case, or two with
    # prefetch (the next layer's reads need slots while this layer's are still pinned)
    host = max(options.host_cache, minimum * (2 if options.prefetch else 1))
    cache = ExpertCache(
        emap,
        host,
        reader,
        top_k=top_k,
        piece_bytes=options.piece,
        lock_memory=options.lock_memory,
        warn_working_set=False,
        policy_factory=policy,
    )
    gpu = GpuTier(emap, options.gpu_cache, device, top_k, policy())
    if gpu.capacity * gpu.slot_bytes + cache.allocated_bytes < working_set:
        warnings.warn(
            f"GPU + host cache ({format_size(gpu.capacity * gpu.slot_bytes + cache.allocated_bytes)}) is "
            f"smaller than one token's working set ({format_size(working_set)})",
            RuntimeWarning,
            stacklevel=3,
        )
    return cache, CudaExpertRuntime(cache, gpu, kwargs.pop("act_fn"), **kwargs)


def uses_unified_memory(options: EngineOptions, device: torch.device) -> bool:
    """--unified, or by default on integrated GPUs (Jetson), whose memory is the host's."""
    if options.unified is not None:
        return options.unified
    return bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))


def _math_kwargs(emap: ExpertMap, config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    cfg = text_config(config)
    if emap.family != "gpt_oss":
        return {"act_fn": ACT2FN[cfg.hidden_act]}
    biases = {key: _read_tensor(ref, dtype).to(device) for key, ref in emap.resident.items()}
    # transformers < 5.2x hard-codes these two constants of gpt-oss's clamped SwiGLU
    params = GptOssParams(
        alpha=float(getattr(cfg, "swiglu_alpha", 1.702)), limit=float(getattr(cfg, "swiglu_limit", 7.0))
    )
    return {"act_fn": None, "gpt_oss": params, "biases": biases}


def _read_tensor(ref: Any, dtype: torch.dtype) -> torch.Tensor:
    with open(ref.file, "rb") as f:
        f.seek(ref.offset)
        raw = bytearray(f.read(ref.nbytes))
    return torch.frombuffer(raw, dtype=TORCH_DTYPES[ref.dtype]).reshape(ref.shape).to(dtype)

"""No silent no-ops: an engine option that cannot take effect where it is used is refused (one sentence,
MoestreamError) or, where it is harmless, warned about once with the reason (`warnings.warn`, which the
CLI prints as one line).

`refuse_unused` looks at the options alone (before anything is read); `warn_unused` at the loaded model
(what the checkpoint stores, what the cache holds).
"""

from __future__ import annotations

import warnings
from typing import Any

from moestream.errors import MoestreamError
from moestream.units import parse_size

# values of the CUDA tier sizes that mean "not given" (the CLI's defaults, and the sizing logic's "auto")
_UNSET = (None, "auto", 0, "0")
_CUDA_ONLY = {
    "gpu_cache": "--gpu-cache (gpu_cache)",
    "host_cache": "--host-cache (host_cache)",
    "unified": "--unified (unified)",
}


def refuse_unused(device: str, given: dict[str, Any]) -> None:
    """Refuse `given` options (the engine options a caller passed) that `device` would ignore.

    Warns about --cache beside a different --gpu-cache on CUDA (the torch path's: one of them sizes
    nothing; `moestream.load` has mapped ggml's CUDA backend's onto its own options, device "cpu").

    Raises:
        MoestreamError: a CUDA tier option on the CPU; a GPU slot size with unified memory; --dtype and
            --trunk-dtype naming different dtypes (a dequantized trunk is computed in its own).
    """
    cuda = str(device).startswith("cuda")
    named = [flag for name, flag in _CUDA_ONLY.items() if given.get(name) not in _UNSET]
    if named and not cuda:
        raise MoestreamError(
            f"{' and '.join(named)} {'apply' if len(named) > 1 else 'applies'} to the CUDA tiers "
            "(--device cuda) only; on the CPU the expert cache is --cache"
        )
    if cuda and given.get("unified") is True:
        tiers = [flag for flag in named if not flag.startswith("--unified")]
        if tiers:
            raise MoestreamError(
                f"{' and '.join(tiers)} {'size' if len(tiers) > 1 else 'sizes'} the GPU slot tiers, which "
                "--unified replaces with one tier of device-mapped host memory: --cache sets its size"
            )
    sizes = [given.get(name) for name in ("cache", "gpu_cache")]
    if cuda and all(size not in _UNSET for size in sizes) and _bytes(sizes[0]) != _bytes(sizes[1]):
        warnings.warn(
            f"--cache {sizes[0]} and --gpu-cache {sizes[1]} both size the expert tier on the torch CUDA "
            "path: the GPU slots take --gpu-cache (and the pinned host tier --host-cache), unified memory "
            "takes --cache; the other is unused",
            stacklevel=3,
        )
    dtype, trunk_dtype = given.get("dtype", "auto"), given.get("trunk_dtype")
    if trunk_dtype is not None and dtype not in (None, "auto", trunk_dtype):
        raise MoestreamError(
            f"--dtype {dtype} and --trunk-dtype {trunk_dtype} disagree: a dequantized trunk is computed "
            "in its own dtype; give one of them"
        )


def _bytes(size: Any) -> Any:
    try:
        return parse_size(size)
    except (TypeError, ValueError):
        return size  # EngineOptions names the bad size


def warn_unused(loaded: Any) -> None:
    """Warn once about options the loaded model (a `LoadedModel`) honours in name only."""
    options = loaded.options
    if options.trunk_dtype is not None and not loaded.has_block_trunk:
        warnings.warn(
            f"--trunk-dtype {options.trunk_dtype}: {loaded.path.name} stores no non-expert weight in GGUF "
            f"block types, so there is nothing to dequantize; the trunk is computed in "
            f"{options.trunk_dtype}, as --dtype {options.trunk_dtype} would do",
            stacklevel=3,
        )
    if loaded.device.type == "cuda" and not options.lock_memory:
        warnings.warn(
            "--no-mlock: on a CUDA device the host slots are page-locked for the copies to the GPU "
            "(cudaHostRegister) whatever it says, and the trunk lives on the GPU",
            stacklevel=3,
        )
    # the tier experts are computed from: the host cache (CPU, unified memory) or the GPU slots
    capacity = getattr(loaded.runtime.tier, "capacity", loaded.cache.capacity)
    holds_all = capacity >= len(loaded.emap.units)
    if options.experts_per_token is not None and loaded.top_k == loaded.model_top_k:
        warnings.warn(
            f"--experts-per-token {options.experts_per_token} is the model's own top-k: nothing changes",
            stacklevel=3,
        )
    if not options.preload and not holds_all:
        warnings.warn(
            f"--no-preload: the expert cache holds {capacity} of {len(loaded.emap.units)} experts, so none "
            "is read at load anyway (only a cache that holds them all is)",
            stacklevel=3,
        )
    if holds_all and options.prefetch != "off":
        warnings.warn(
            f"--prefetch {options.prefetch}: the expert cache holds all {len(loaded.emap.units)} experts, "
            "so once each was read there is nothing left to read ahead",
            stacklevel=3,
        )
    if holds_all and options.policy != "lru" and options.gpu_tier is None:  # else the GPU tier's policy
        warnings.warn(
            f"--policy {options.policy}: the expert cache holds all {len(loaded.emap.units)} experts, so "
            "nothing is ever evicted and the policy never chooses",
            stacklevel=3,
        )

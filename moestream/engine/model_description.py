"""`ModelDescription`: what the memory plan and the auto budgets know of a model being loaded, frozen.

Made once the checkpoint's config and expert map are read (before the trunk is: `memory_plan` refuses a
run that cannot fit before anything is read or locked), and made again, with what the built model adds
(its dtype, the ggml graphs' spec, the expert family's fusions), before the auto budgets are sized
(`auto_budget`). Nothing here is a live object the plan could change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moestream.engine.kvcache import kv_cache_bytes
from moestream.model.arch import Arch
from moestream.store.experts import ExpertMap
from moestream.store.source import CheckpointSource


@dataclass(frozen=True)
class ModelDescription:
    source: CheckpointSource  # where the trunk's tensors are looked up (`trunk_tensors`)
    config: Any  # the model's transformers config
    arch: Arch
    emap: ExpertMap  # the routed experts: every (layer, expert)'s parts and bytes
    top_k: int  # experts per token in use
    device: torch.device
    ctx_size: int  # positions a request may use
    threads: int  # compute threads
    parallel: int = 1  # sequences decoded together: KV caches of `ctx_size` positions each
    # known once the model is built
    dtype: torch.dtype | None = None  # the trunk's compute dtype
    spec: Any = None  # the ggml graphs' `ModelSpec`, where they run the model
    fusions: dict[str, tuple[str, ...]] = field(default_factory=dict)  # the expert family's fused kinds

    @property
    def kv_bytes(self) -> int:
        """transformers' KV cache at the full context, in the model's dtype (one per parallel slot)."""
        if self.dtype is None:
            raise ValueError("the KV cache's size is known once the model is built")
        return kv_cache_bytes(self.config, self.ctx_size, self.dtype.itemsize) * self.parallel

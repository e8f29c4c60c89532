"""`LoadedModel`: what a load takes, owned in one place, in one `contextlib.ExitStack`.

The checkpoint source and its config, the expert map, the expert family, the transformers model, the
trunk's memory lock, the expert streaming (reader, cache, tier, runtime), the door the runner reaches
the experts through (`ExpertLayers`), the runner that computes a step, and the GPU clock floor. Each
resource is registered with the stack as soon as it is taken, so a load that fails (an error, Ctrl-C
during a read or a graph build) leaves nothing open, and `close` frees them all, the last taken first.
`restream` rebuilds the expert streaming with other sizes or I/O settings and, where that fails, the
previous one. The `Engine` (engine/engine.py) keeps what a request needs besides: the tokenizer,
prompts, the prompt cache, sampling, traces and the token loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from moestream.cache.expert_cache import ExpertCache
from moestream.cache.read_at_load import read_all
from moestream.engine.auto_budget import PARALLEL_CHOICES, AutoBudget, auto_parallel, size_auto
from moestream.engine.describe import describe
from moestream.engine.memory import TrunkLock
from moestream.engine.memory_plan import plan_memory, plan_restream
from moestream.engine.model_description import ModelDescription
from moestream.engine.options import AUTO, EngineOptions
from moestream.engine.prompts import context_size
from moestream.engine.runners import ModelRunner
from moestream.engine.stats import Counters
from moestream.engine.trunk import ggml_spec, make_runner, runner_backend
from moestream.engine.trunk_release import TrunkOnDevice, upload_trunk
from moestream.engine.unused import refuse_unused
from moestream.errors import MoestreamError
from moestream.ggml.backend import DeviceMemory
from moestream.ggml.graphs import set_threads as ggml_threads
from moestream.ggml.host import default_threads
from moestream.io.reader import CheckpointFiles, Reader
from moestream.model.arch import arch_for, num_experts, text_config, top_k
from moestream.model.loader import build_model, router_modules, streaming_modules, trunk_tensors
from moestream.model.quantized import block_bytes
from moestream.runtime.checks import check_experts
from moestream.runtime.expert_layers import ExpertLayers
from moestream.runtime.experts import ExpertRuntime
from moestream.runtime.families import make_family
from moestream.runtime.streaming import ExpertStreaming, ReaderFactory, policy_factory
from moestream.store.source import CheckpointSource
from moestream.units import format_size

# what `restream` may change: the streaming's sizes and I/O settings, not the model
RESTREAM_OPTIONS = (
    "cache",
    "io_mode",
    "io_threads",
    "piece",
    "lock_memory",
    "gpu_cache",
    "host_cache",
    "prefetch",
    "policy",
    "preload",
)


class LoadedModel:
    """A model loaded from `source` (its `config` read) with `options`, its routed experts streamed."""

    def __init__(
        self,
        source: CheckpointSource,
        config: Any,
        options: EngineOptions,
        make_reader: ReaderFactory | None = None,
    ) -> None:
        self.source, self.config, self.path = source, config, source.path
        self.make_reader = make_reader or Reader  # tests inject others (faults)
        self.closed = False
        self.broken: str | None = None  # why a failed restream left no working streaming
        # -t: compute threads in total; by default the physical cores (llama.cpp's rule)
        self.threads = options.threads or default_threads()
        with contextlib.ExitStack() as stack:
            torch.set_num_threads(self.threads)
            ggml_threads(self.threads)
            stack.callback(ggml_threads, None)  # ggml's later computes outside a model: torch's count again
            stack.callback(_empty_cuda_cache)  # after everything below: its GPU memory back at once
            description = self._read_checkpoint(options)
            stored = self._plan(description, options)
            # every expert file held open from before the trunk is read until close: the reader (and every
            # reader a restream builds) reads the files the model was loaded from, even once they are
            # replaced on disk (said once: `notices`)
            self.files = CheckpointFiles(self.emap.files)
            stack.callback(self.files.close)
            self._build_model(stored)
            # the ggml graphs' view of the model, when they run it (before the experts' formats are chosen)
            self.spec, self.no_graph = ggml_spec(self.model, options.trunk, self.device, options.ggml_device)
            self.trunk = TrunkLock(self.model)  # the trunk is anonymous memory (read, not mapped): lockable
            self.trunk_blocks = block_bytes(self.model)  # (read before a backend takes the trunk)
            # the ggml backend the graphs compute on (None: the CPU in place), the runner's once it is built;
            # there the trunk is copied to the device and its host copy given back (but the routers') before
            # it is locked and the cache sized and taken (`engine/trunk_release.py`)
            self.trunk_device: TrunkOnDevice | None = None
            memory = None
            backend = runner_backend(self.spec, self.threads, self.options.ggml_device)
            if backend is not None:
                stack.callback(backend.close)
                memory = DeviceMemory(backend)
                stack.callback(memory.close)  # (before the backend's)
                self.trunk_device = upload_trunk(self.model, self.spec, memory, self.trunk)
            if self.options.lock_memory:
                self.trunk.lock()
            stack.callback(self.trunk.unlock)
            self.modules = streaming_modules(self.model)
            self.emap.restrict([layer for layer, _ in self.modules])
            self.family = make_family(self.config, self.emap, self.device, self.dtype)
            self.description = dataclasses.replace(
                description, dtype=self.dtype, spec=self.spec, fusions=dict(self.family.fusions)
            )
            # --parallel auto: the slots the runner can batch and the memory affords, before the cache
            self.parallel_auto: str | None = None  # the mode line's words for an auto choice
            if self.options.parallel == AUTO:
                slots, self.parallel_auto = auto_parallel(self.description, self.options, self.no_graph)
                self.options = dataclasses.replace(self.options, parallel=slots)
                self.description = dataclasses.replace(self.description, parallel=slots)
            # an auto budget: what the memory leaves now that the trunk is in (refused if below the minimum)
            self.auto: list[AutoBudget]
            self.options, self.auto = size_auto(self.description, self.options)
            self.streaming = self._build_streaming()
            stack.callback(lambda: self.streaming.close())  # the one in use then (a restream replaces it)
            self.experts = ExpertLayers(self.streaming, self.top_k)
            if memory is not None and self.parallel_auto is not None and self.options.parallel > 1:
                self._device_parallel(memory)
            # what computes the steps, chosen once: it owns the static cache, graphs, ggml KV cache
            self.runner: ModelRunner = make_runner(
                self.model,
                self.options.trunk,
                self.modules,
                self.device,
                self.ctx_size,
                self.experts,
                self.threads,
                self.spec,
                self.no_graph,
                self.options.gpu_tier,
                policy_factory(self.options.policy, self.emap),
                self.options.parallel,
                self.trunk.nbytes,
                backend,
                memory,
            )
            stack.callback(self.runner.close)  # its graphs and static cache: before the slots they read
            self._trunk_base = self.runner.describe()
            if self.options.gpu_path_why:  # --device cuda on the torch path: why not ggml's CUDA backend
                self._trunk_base += f" (torch CUDA path: {self.options.gpu_path_why})"
            if self.runner.owns_compute_pool:  # one pool: ggml's; torch only runs glue in between
                torch.set_num_threads(1)
            self.trunk_line = self._trunk_base + self._read_resident()
            self.floor = self._make_floor()
            if self.floor is not None:
                stack.callback(self.floor.close)  # the GPU clock floor restored first
            self._stack = stack.pop_all()

    # --- the load, step by step -----------------------------------------------------------------

    def _read_checkpoint(self, options: EngineOptions) -> ModelDescription:
        """The architecture, the expert map (checked before the trunk is read: a bad expert fails at
        once), the top-k in use, the device and the context: the model's description before its build."""
        self.arch = arch_for(self.config)
        self.model_top_k = top_k(self.config)
        if options.experts_per_token is not None:
            _override_top_k(self.config, options.experts_per_token)
        self.emap = self.source.expert_map(self.arch.family, num_experts(self.config))
        check_experts(self.emap, self.config)
        self.top_k = top_k(self.config)
        self.device = torch.device(options.device)
        self.ctx_size = context_size(options.ctx_size, context_length(self.config))
        return ModelDescription(
            self.source,
            self.config,
            self.arch,
            self.emap,
            self.top_k,
            self.device,
            self.ctx_size,
            self.threads,
            1 if options.parallel == AUTO else options.parallel,  # auto: planned for one until chosen
        )

    def _plan(self, description: ModelDescription, options: EngineOptions) -> dict[str, Any]:
        """The trunk's tensors (nothing read yet); the options to run with, refused with the numbers
        (before anything is read or locked) where the run cannot fit."""
        keep = options.trunk_dtype is None
        stored = trunk_tensors(self.source, self.config, self.arch, self.emap, keep)
        self.has_block_trunk = _has_blocks(
            stored if keep else trunk_tensors(self.source, self.config, self.arch, self.emap)
        )
        self.options = plan_memory(description, options, stored)
        return stored

    def _build_model(self, stored: dict[str, Any]) -> None:
        options = self.options
        dtype = options.trunk_dtype or options.dtype  # a dequantized trunk is computed in its dtype
        dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = build_model(self.source, self.config, self.arch, dtype, stored)
        if self.device.type == "cuda":
            self.model.to(self.device)  # every non-expert weight; StreamingExperts has none

    def _device_parallel(self, memory: Any) -> None:
        """--parallel auto on a ggml backend: of the slots the host's plan allowed, the most the device's
        memory holds beside the trunk and the experts (`device_parallel`), said with the host's words
        where the host allowed fewer than the most."""
        from moestream.engine.device_parallel import device_parallel

        host, host_words = self.options.parallel, self.parallel_auto
        slots, words = device_parallel(
            memory,
            self.spec,
            self.experts,
            self.ctx_size,
            self.threads,
            self.trunk.nbytes,
            self.options.gpu_tier,
            host,
        )
        if host < max(PARALLEL_CHOICES):
            words += f"; in RAM: {host_words}"
        self.parallel_auto = words
        self.options = dataclasses.replace(self.options, parallel=slots)
        self.description = dataclasses.replace(self.description, parallel=slots)

    def _build_streaming(self) -> ExpertStreaming:
        """A fresh reader, cache, tier and runtime, bound to every StreamingExperts module."""
        streaming = ExpertStreaming(
            self.emap,
            self.family,
            self.options.stream_config(),
            top_k=self.top_k,
            device=self.device,
            make_reader=self.make_reader,
            graph_kernels=self.spec is not None,
            files=self.files,
        )
        if self.options.prefetch != "off":
            streaming.enable_lookahead(router_modules(self.model))
        streaming.bind(self.modules)
        return streaming

    def _read_resident(self) -> str:
        """Every expert read at load where the cache holds them all (unless `preload` is off): into the
        GPU tier, the step then one graph; or into the host cache that the kernels read in place (CPU,
        unified memory), so that no request waits for a first read."""
        if not self.options.preload:
            return ""
        words = self.runner.resident_part(int(text_config(self.config).hidden_size))
        cache = self.streaming.cache
        if words or not self.runtime.tier.in_place or cache is None or not cache.holds_all():
            return words
        start = time.perf_counter()
        read = format_size(read_all(cache))
        return f"; every expert cached, read at load ({read} in {time.perf_counter() - start:.1f} s)"

    def _make_floor(self) -> Any:
        from moestream.power.floor import make_engine_floor

        return make_engine_floor(
            self.options.gpu_floor,
            sysfs_root=self.options.sysfs_root,
            # ggml's CUDA backend (--device cuda) computes the experts on the GPU; torch's device is the CPU
            experts_off_gpu=self.options.device == "cpu" and self.options.ggml_device is None,
        )

    # --- what a loaded model does ---------------------------------------------------------------

    @property
    def runtime(self) -> ExpertRuntime:
        return self.streaming.runtime

    @property
    def cache(self) -> ExpertCache:
        return self.streaming.cache

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def unavailable(self) -> str | None:
        """Why this model cannot compute (closed, or left without a working streaming setup), or None."""
        return "the engine is closed" if self.closed else self.broken

    def step(self, ids: list[int], cache: Any) -> tuple[torch.Tensor, Any]:
        """Feed `ids` after what `cache` holds (None: from scratch): (last position's logits [V] float32
        on the host, the cache), by the runner chosen at load."""
        return self.runner(ids, cache)

    def restream(self, **changes: Any) -> None:
        """Rebuild reader, cache and runtime with other `cache`, `io_mode`, `io_threads`, `piece`,
        `lock_memory`, `policy`, `prefetch`, `preload` or the CUDA tiers, keeping the loaded model:
        side-by-side comparisons without reloading. A routing replay carries over. Where the new
        setup fails, the previous one is built again (and where that fails too, the model is `broken`).

        Raises:
            ValueError: an option restream cannot change.
            MoestreamError: a bad or auto size, an option this device ignores, no room, or the model
                is closed or broken.
        """
        unknown = set(changes) - set(RESTREAM_OPTIONS)
        if unknown:
            raise ValueError(f"restream cannot change {', '.join(sorted(unknown))}")
        tiers = {k: v for k, v in changes.items() if k in ("gpu_cache", "host_cache")}
        if self.options.ggml_device is not None and tiers:
            raise MoestreamError(
                f"on ggml's CUDA backend (--device {self.options.ggml_device}) restream resizes the host "
                "expert cache (cache); the GPU tier is sized at load"
            )
        refuse_unused(self.options.device, {**tiers, "unified": self.options.unified})  # as at load
        try:
            options = EngineOptions(**{**vars(self.options), **changes})
        except ValueError as exc:
            raise MoestreamError(str(exc)) from None
        if options.auto:
            raise MoestreamError("restream takes sizes: an auto budget is sized when the model loads")
        if self.unavailable is not None:
            raise MoestreamError(self.unavailable)
        options = plan_restream(self.description, options, self.cache)  # against the room it gives back
        previous, replay, old = self.options, self.runtime.replay, self.streaming
        self.runner.before_restream()  # what reads the slot buffer closed next
        self.trunk_line = self._trunk_base
        old.close()
        try:
            self.options = options
            self._rebind(replay)
            self.trunk_line = self._trunk_base + self._read_resident()
            self.auto = []  # the sizes given now are the ones in use
        except BaseException as exc:  # the previous setup, so that a failed restream leaves a usable model
            self.options = previous
            self.streaming.close()  # what the new setup took, where it was built (a read at load failed)
            try:
                self._rebind(replay)
            except BaseException as again:
                self.broken = (
                    f"a restream failed ({exc}) and the previous setup could not be rebuilt ({again})"
                )
                raise
            raise

    def _rebind(self, replay: Any) -> None:
        """A new streaming for the options in use, the door and the replay moved onto it."""
        self.streaming = self._build_streaming()
        self.experts.bind(self.streaming)
        self.runtime.replay = replay

    def describe(self, notes: Sequence[str] = ()) -> str:
        """The mode line (`engine/describe.py`), `notes` (the engine's: a routing replay) after the floor."""
        return describe(self, notes)

    def context_line(self) -> str:
        """The context part of the mode line: tokens, and the KV cache's memory when it is full."""
        slots = self.options.parallel  # sequences decoded together, a KV cache each
        each = f" ({format_size(self.kv_bytes // slots)} a slot)" if slots > 1 else ""
        return (
            f"context {self.ctx_size} tokens, KV cache {format_size(self.kv_bytes)} when full{each}, "
            f"parallel {slots}" + (f" (auto: {self.parallel_auto})" if self.parallel_auto is not None else "")
        )

    @property
    def kv_bytes(self) -> int:
        """transformers' KV cache at the full context, in the model's dtype."""
        return self.description.kv_bytes

    def counters(self) -> Counters:
        """Cumulative counters. A hit is an expert not read from disk (GPU tier or host cache)."""
        c = self.experts.counters()
        tier = self.runner.tier_counters()
        return Counters(c.bytes_read, c.hits, c.misses, c.read_wait_s, c.prefetches, c.prefetch_used, tier)

    def close(self) -> None:
        """Restore the GPU clock floor, free the runner's graphs and caches, stop the I/O threads and close
        the checkpoint files, unlock and free the expert cache and unlock the trunk, at once."""
        if self.closed:
            return
        self.closed = True
        self._stack.close()


def context_length(config: Any) -> int | None:
    """Positions the model was trained for (`max_position_embeddings`; None when the config has none)."""
    value = getattr(text_config(config), "max_position_embeddings", None)
    return int(value) if value else None


def _empty_cuda_cache() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _has_blocks(tensors: dict[str, Any]) -> bool:
    """Whether the trunk stores weights in GGUF block types (what --trunk-dtype dequantizes)."""
    from moestream.store.tensors import QuantizedTensor

    return any(isinstance(t, QuantizedTensor) for t in tensors.values())


def _override_top_k(config: Any, k: int) -> None:
    """Route every token to `k` experts instead of the model's top-k (lossy; the routers read it at build)."""
    cfg = text_config(config)
    if k > num_experts(config):
        raise MoestreamError(
            f"--experts-per-token {k} exceeds the model's {num_experts(config)} routed experts"
        )
    cfg.num_experts_per_tok = k

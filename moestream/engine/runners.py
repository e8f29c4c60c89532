"""The `ModelRunner`s: what computes a step of the model, one per backend, chosen once at load
(`engine/trunk.py` `make_runner`, from `--trunk`). A runner owns the model's step state (a static KV
cache, CUDA graphs, ggml graphs and their KV cache); the `Engine` keeps the requests, the prompt cache
and the token loop (`engine/loop.py`), which calls the runner.

- `EagerRunner`: transformers' forward, op by op, over its dynamic KV cache (every family; the
  reference).
- `StaticRunner`: the same forward over one transformers StaticCache that every request runs in, op by
  op (`--trunk static`: the graphs' oracle).
- `CudaGraphRunner`: that static cache, prefill op by op and each one-token decode replayed as CUDA
  graphs between the MoE layers' experts (`engine/trunk_graphs.py`), or the whole step as one graph when
  every expert is in the GPU tier (`runtime/resident.py`).
- `GgmlRunner` (`engine/ggml_runner.py`): each decoder layer as ggml graphs, one thread pool.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any

import torch

from moestream.engine.logits import DeviceLogits
from moestream.engine.loop import Launched
from moestream.engine.stats import TierCounters
from moestream.engine.trunk_graphs import DecodeGraphs, GraphsUnavailable
from moestream.runtime.expert_layers import ExpertLayers


class ModelRunner(ABC):
    """Computes the model's steps: `runner(ids, cache)` feeds `ids` after what `cache` holds (None: a
    request from scratch) and returns (the last position's logits [V] float32 on the host, the cache).

    The cache is what the prompt cache keeps between requests (`engine/prompt_cache.py`): it answers
    `get_seq_length()` and `crop(n)`, whatever the runner keeps behind it.
    """

    # whether the runner's compute runs on a thread pool of its own (ggml's): the engine then sets torch's
    # to one thread, so that two pools never compete for the cores
    owns_compute_pool = False

    def __call__(
        self, ids: list[int], cache: Any, greedy: bool = False
    ) -> tuple[torch.Tensor | DeviceLogits, Any]:
        """Feed `ids` after what `cache` holds; returns (last-position logits [V] fp32 on the host, cache).
        `greedy`: the caller takes the logits' argmax alone (`Sampler.plain`); a runner that computes it
        where the logits are (ggml's on a backend) may then return a `DeviceLogits` in their place, the
        others return the tensor."""
        # torch's inference mode, entered as `torch.inference_mode` enters it (its guard), without the
        # decorator's per-call context object and clone (a third of the cost, once a decoded token)
        with torch._C._InferenceMode(True):
            return self.forward(ids, cache, greedy)

    @abstractmethod
    def forward(
        self, ids: list[int], cache: Any, greedy: bool = False
    ) -> tuple[torch.Tensor | DeviceLogits, Any]:
        """`__call__`'s step, run under torch's inference mode."""

    def launch(self, ids: list[int], cache: Any, greedy: bool = False) -> Launched | None:
        """Start `__call__`'s step where the runner computes it asynchronously (ggml's on a backend: one
        decoded token's graph), returning what waits for it and gives `__call__`'s result; None where it
        does not (nothing started: call the runner). Until that is called, nothing else may use the
        runner. The token loop starts a plainly greedy request's next step so before it hands out the
        token (`engine/loop.py`)."""
        return None

    @abstractmethod
    def describe(self) -> str:
        """The mode line's words for this runner ("trunk ...")."""

    def before_restream(self) -> None:
        """The expert streaming is about to be closed and rebuilt: drop whatever reads its buffers."""

    def tier_counters(self) -> TierCounters | None:
        """A GPU tier's cumulative counters where the runner keeps one (ggml's backend), else None."""
        return None

    def resident_part(self, hidden_size: int) -> str:
        """(Re)build what computes the step from every expert held resident, where the runner has such a
        step and the streaming bound now holds them all (at load, and after each restream); returns the
        mode line's words for it ("" when there is none)."""
        return ""

    def close(self) -> None:
        """Free what the runner holds (engine close): caches, graphs, their buffers."""


class TransformersRunner(ModelRunner):
    """A transformers causal LM called one step at a time, whatever its cache argument is called
    (`past_key_values` up to transformers 5.23, `cache` from 5.24)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.trim_logits = "logits_to_keep" in params
        self.device = next(model.parameters()).device

    def logits(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """ids [1, T] on the model's device -> (last position's logits [V] fp32 on the device, cache)."""
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True}
        if self.trim_logits:
            kwargs["logits_to_keep"] = 1
        if cache is not None:
            kwargs[self.cache_arg] = cache
        out = self.model(**kwargs)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[0, -1].float(), new_cache

    def forward(self, ids: list[int], cache: Any, greedy: bool = False) -> tuple[torch.Tensor, Any]:
        logits, new_cache = self.logits(torch.tensor([ids], device=self.device), cache)
        return logits.cpu(), new_cache  # sampling runs on the host


class EagerRunner(TransformersRunner):
    """transformers' forward, op by op, over its dynamic KV cache (a new one per request). `words`: the
    mode line's, which say why auto fell back to it where it did."""

    def __init__(self, model: torch.nn.Module, words: str = "trunk eager (dynamic KV cache)") -> None:
        super().__init__(model)
        self.words = words

    def describe(self) -> str:
        return self.words


def static_cache(model: torch.nn.Module, tokens: int) -> Any:
    """A transformers StaticCache of `tokens` positions for `model`."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=tokens)


class StaticRunner(TransformersRunner):
    """transformers' forward over one StaticCache of `ctx_size` tokens that every request runs in: a
    request that starts without a cache gets it emptied. `graphs` (DecodeGraphs over that cache) checks
    at load that the model's step runs over it (`check`); here they are never replayed."""

    def __init__(
        self,
        model: torch.nn.Module,
        ctx_size: int,
        modules: dict[int, Any],
        device: torch.device,
        experts: ExpertLayers,
    ) -> None:
        super().__init__(model)
        self.ctx_size = ctx_size
        cache = static_cache(model, ctx_size)
        self.static: Any = None  # set once the check passed: the cache every request runs in
        forward = lambda ids: self.logits(ids, cache)[0]  # noqa: E731
        self.graphs: Any = DecodeGraphs(forward, cache, modules, device, experts)

    def check(self) -> None:
        """Run the step eagerly over the static cache (positions 0 and 1, the experts answering zeros).

        Raises:
            GraphsUnavailable: the cache keeps a position on the host, or the step fails over it.
        """
        self.graphs.trial()
        self.static, self.graphs = self.graphs.cache, None

    def describe(self) -> str:
        return f"trunk static KV cache of {self.ctx_size} tokens, eager ops"

    def forward(self, ids: list[int], cache: Any, greedy: bool = False) -> tuple[torch.Tensor, Any]:
        return super().forward(ids, self._request_cache(cache))

    def _request_cache(self, cache: Any) -> Any:
        """`cache`, or for a request from scratch (None) the static cache emptied."""
        if cache is None:
            self.static.reset()  # a request from scratch: positions and states back to empty
            cache = self.static
        return cache

    def close(self) -> None:
        self.graphs = self.static = None


class CudaGraphRunner(StaticRunner):
    """`StaticRunner` whose one-token steps replay CUDA graphs (`engine/trunk_graphs.py`) instead of
    launching the trunk's ops one by one; with `one_graph`, the whole step is one graph when every
    expert is in the GPU tier (`resident_part`: the device slot tables `experts` gives)."""

    def __init__(
        self,
        model: torch.nn.Module,
        ctx_size: int,
        modules: dict[int, Any],
        device: torch.device,
        experts: ExpertLayers,
        one_graph: bool,
    ) -> None:
        super().__init__(model, ctx_size, modules, device, experts)
        self.experts, self.one_graph = experts, one_graph

    def check(self) -> None:
        """Warm up, capture and check the per-layer graphs.

        Raises:
            GraphsUnavailable: the cache or an op of the step cannot be captured, or the replay differs
                from the eager step.
        """
        self.graphs.capture()
        self.static = self.graphs.cache

    def describe(self) -> str:
        return f"{self.graphs.describe()} over a static KV cache of {self.ctx_size} tokens"

    def forward(self, ids: list[int], cache: Any, greedy: bool = False) -> tuple[torch.Tensor, Any]:
        cache = self._request_cache(cache)
        if len(ids) == 1:
            return self.graphs.step(ids[0]), cache
        return TransformersRunner.forward(self, ids, cache)  # a prefill: op by op

    def before_restream(self) -> None:
        self.graphs.drop_whole()  # it reads the slot buffer closed next

    def resident_part(self, hidden_size: int) -> str:
        """(Re)build the one-graph step over every expert resident in the GPU tier, where the tier bound
        now can hold them all; "" when it cannot or `one_graph` is off.

        Raises:
            ExpertReadError: reading an expert failed (the split graphs stay in use).
        """
        graphs = self.graphs
        if graphs is None or not self.one_graph:
            return ""
        graphs.drop_whole()
        resident = self.experts.device_tables()
        if resident is None:
            return ""
        resident.load_all(hidden_size, next(self.model.parameters()).dtype)
        try:
            graphs.capture_whole(resident)
        except GraphsUnavailable as exc:
            return f"; every expert in the GPU tier, but not one graph a token: {exc}"
        return "; every expert resident in the GPU tier (read at load): one graph a token"

"""A one-token decode step's trunk as CUDA graphs, broken only where the routed experts run.

In a decode step everything but the routed experts is a fixed sequence of small kernels: the embedding,
per layer the norms, attention over the KV cache, the router and the residual adds, then the final norm
and the LM head. Launched op by op from transformers' Python that is ~2-3 ms of host time a layer on an
H200 (BENCHMARKS.md, issue 17), far more than the kernels take. Here transformers' own forward runs once,
at capture, over a static KV cache whose positions live on the device (so one graph serves every
position), and each stretch of kernels between two MoE layers' experts calls is recorded as one graph:

    graph 0   embedding, layer 0 up to its router       -> layer 0's (hidden, top-k index, weights)
    experts   ExpertRuntime.forward of layer 0, eager    -> copied into the buffer graph 1 reads
    graph 1   the rest of layer 0, layer 1 to its router -> ...
    graph L   the rest of the last MoE layer, the final norm, the LM head -> logits

A token then costs one graph launch per stretch; the experts in between run as they always do, and their
routing readback (which experts to read) is the step's only host sync before the logits.

Capture needs every op between two experts calls free of host syncs and of host-side positions. Caches
that keep a position on the host (sliding-window and linear-attention layers) are refused before capture;
after capture the graphs replay two positions against the eager static step and must match it bit for
bit, so a graph that baked in anything position-dependent is never used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

EAGER_CHECK_TOKENS = (0, 1)  # the capture check feeds these ids at positions 0 and 1


class GraphsUnavailable(Exception):
    """This model's decode step cannot be captured; the message says why (for the mode line)."""


@dataclass
class _ExpertsCall:
    """One MoE layer's experts call as the graphs see it: inputs graph i leaves, the output graph i+1
    reads (fixed addresses: the graphs read and write exactly these tensors at every replay)."""

    layer: int
    hidden: torch.Tensor  # [1, H]
    index: torch.Tensor  # [1, K]
    weights: torch.Tensor  # [1, K]
    out: torch.Tensor  # [1, H]


Experts = Callable[[_ExpertsCall], torch.Tensor]


def static_layers_only(cache: Any) -> None:
    """Refuse a static cache with a layer other than the plain full-attention one: a sliding window
    keeps its position on the host (a graph would bake one position in), and recurrent states were not
    checked here."""
    from transformers.cache_utils import StaticLayer

    for i, layer in enumerate(cache.layers):
        if type(layer) is not StaticLayer:
            raise GraphsUnavailable(
                f"layer {i}'s KV cache is a {type(layer).__name__}; only full-attention layers "
                "(StaticLayer) run from a static KV cache here"
            )


class _Splitter:
    """Stands in for the expert runtime of every StreamingExperts module while the graphs are built:
    "zeros" answers each experts call with zeros (warm-up, check); "capture" ends the running graph at
    each experts call, records the call and begins the next graph."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs, self.mode = graphs, "zeros"

    def forward(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.mode == "zeros":
            return torch.zeros_like(hidden)
        g = self.graphs
        g.graphs[-1].capture_end()
        out = torch.empty_like(hidden)  # outside any capture: an ordinary allocation the graphs keep
        g.calls.append(_ExpertsCall(layer, hidden, top_k_index, top_k_weights, out))
        g.begin()
        return out


class DecodeGraphs:
    """The captured decode step: `forward(ids [1,1])` runs the model over `cache` (a transformers
    StaticCache, the one every request runs in) and returns the logits [V] float32 on the device.

    `modules` maps each MoE layer to its StreamingExperts module; at replay each layer's experts run on
    the runtime the module is bound to then (a restream rebinds it; the graphs do not change).
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        cache: Any,
        modules: dict[int, Any],
        device: torch.device,
    ) -> None:
        self.forward, self.cache, self.modules, self.device = forward, cache, modules, device
        self.ids = torch.zeros((1, 1), dtype=torch.int64, device=self.device)  # the graphs' input
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_ExpertsCall] = []
        self.logits: torch.Tensor | None = None  # [V] float32, written by the last graph
        self.pool: Any = None
        self.stream: torch.cuda.Stream | None = None

    @property
    def segments(self) -> int:
        return len(self.graphs)

    def describe(self) -> str:
        return f"trunk CUDA graphs ({self.segments} between {len(self.calls)} MoE layers' experts)"

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        self.graphs.append(graph)
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    @contextmanager
    def _standing_in(self, splitter: _Splitter) -> Iterator[None]:
        """Every StreamingExperts module answers through `splitter` (no expert is read or counted)."""
        saved = {layer: m.runtime for layer, m in self.modules.items()}
        for m in self.modules.values():
            m.runtime = splitter
        try:
            yield
        finally:
            for layer, m in self.modules.items():
                m.runtime = saved[layer]
            self.cache.reset()

    @torch.inference_mode()
    def trial(self) -> list[torch.Tensor]:
        """Run the step eagerly over the static cache at positions 0 and 1, the experts answering zeros;
        returns the two logits. The cache is left empty.

        Raises:
            GraphsUnavailable: the cache keeps a position on the host, or the step fails over it.
        """
        static_layers_only(self.cache)
        with self._standing_in(_Splitter(self)):
            return self._eager_steps()

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up, capture and check the graphs; the cache is left empty.

        Raises:
            GraphsUnavailable: the cache or an op of the step cannot be captured, or the replay differs
                from the eager step; nothing captured is kept.
        """
        static_layers_only(self.cache)
        splitter = _Splitter(self)
        self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with self._standing_in(splitter):
                with torch.cuda.stream(self.stream):
                    eager = self._eager_steps()  # also the warm-up: allocations, kernel choices, compiling
                    self.cache.reset()
                    torch.cuda.synchronize(self.device)
                    self.pool = torch.cuda.graph_pool_handle()
                    splitter.mode = "capture"
                    self._capture()
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
                self._check(eager)
        except BaseException:
            self.graphs, self.calls, self.logits, self.pool = [], [], None, None
            raise

    def _eager_steps(self) -> list[torch.Tensor]:
        self.cache.reset()
        out = []
        try:
            for token in EAGER_CHECK_TOKENS:
                self.ids.fill_(token)
                out.append(self.forward(self.ids).clone())
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            raise GraphsUnavailable(
                f"the decode step fails over a static KV cache ({type(exc).__name__}: {exc})"
            ) from exc
        return out

    def _capture(self) -> None:
        self.begin()
        try:
            self.logits = self.forward(self.ids)
        except Exception as exc:
            self._abort()
            raise GraphsUnavailable(
                f"the decode step cannot be captured ({type(exc).__name__}: {exc})"
            ) from exc
        except BaseException:
            self._abort()
            raise
        self.graphs[-1].capture_end()
        if not self.calls:
            raise GraphsUnavailable("the decode step called no streamed experts")

    def _abort(self) -> None:
        """End a capture that failed half-way (the stream must leave capture mode to be usable again)."""
        if self.graphs and torch.cuda.is_current_stream_capturing():
            try:
                self.graphs[-1].capture_end()
            except RuntimeError:
                pass  # an invalidated capture ends with an error: the stream is out of capture mode now

    def _check(self, eager: list[torch.Tensor]) -> None:
        """Replay positions 0 and 1 with zero experts against the eager steps: the same bits."""
        self.cache.reset()
        for position, (token, want) in enumerate(zip(EAGER_CHECK_TOKENS, eager)):
            got = self._replay(token, lambda call: torch.zeros_like(call.hidden))
            if not torch.equal(got, want):
                diff = (got - want).abs().max().item()
                raise GraphsUnavailable(
                    f"the captured step differs from the eager one at position {position} (max |diff| "
                    f"{diff:.3g}): something in it depends on the position on the host"
                )

    def _replay(self, token: int, experts: Experts) -> torch.Tensor:
        self.ids.fill_(token)
        for graph, call in zip(self.graphs, self.calls):
            graph.replay()
            call.out.copy_(experts(call))
        self.graphs[-1].replay()
        assert self.logits is not None
        return self.logits

    def _streamed(self, call: _ExpertsCall) -> torch.Tensor:
        return self.modules[call.layer].runtime.forward(call.layer, call.hidden, call.index, call.weights)

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token after what the cache holds; returns its logits [V] float32 on the host."""
        return self._replay(token, self._streamed).cpu()

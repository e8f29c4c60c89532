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

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from moestream.runtime.expert_layers import ExpertLayers

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
    each experts call, records the call and begins the next graph; "inline" computes the experts from
    the resident tables (runtime/resident.py), eagerly or into the graph being captured."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs, self.mode = graphs, "zeros"

    def forward(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.mode == "zeros":
            return torch.zeros_like(hidden)
        g = self.graphs
        if self.mode == "inline":
            return g.resident.compute(layer, hidden, top_k_index, top_k_weights)
        g.graphs[-1].capture_end()
        out = torch.empty_like(hidden)  # outside any capture: an ordinary allocation the graphs keep
        g.calls.append(_ExpertsCall(layer, hidden, top_k_index, top_k_weights, out))
        g.begin(g.graphs, g.pool)
        return out


class DecodeGraphs:
    """The captured decode step: `forward(ids [1,1])` runs the model over `cache` (a transformers
    StaticCache, the one every request runs in) and returns the logits [V] float32 on the device.

    `modules` maps each MoE layer to its StreamingExperts module (which the splitter stands in for
    while the graphs are built); at replay each layer's experts run through `experts`, the door to the
    streaming bound then (a restream rebinds it; the graphs do not change).
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        cache: Any,
        modules: dict[int, Any],
        device: torch.device,
        experts: ExpertLayers,
    ) -> None:
        self.forward, self.cache, self.modules, self.device = forward, cache, modules, device
        self.experts = experts
        self.ids = torch.zeros((1, 1), dtype=torch.int64, device=self.device)  # the graphs' input
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_ExpertsCall] = []
        self.logits: torch.Tensor | None = None  # [V] float32, written by the last graph
        self.pool: Any = None
        # every expert resident in the GPU tier: the whole step as one graph (`capture_whole`)
        self.resident: Any = None
        self.whole: torch.cuda.CUDAGraph | None = None
        self.whole_logits: torch.Tensor | None = None

    @property
    def segments(self) -> int:
        return len(self.graphs)

    def describe(self) -> str:
        return f"trunk CUDA graphs ({self.segments} between {len(self.calls)} MoE layers' experts)"

    def begin(self, graphs: list[torch.cuda.CUDAGraph], pool: Any) -> None:
        """Start capturing a new graph, appended to `graphs`, into memory pool `pool`."""
        graph = torch.cuda.CUDAGraph()
        graphs.append(graph)
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")

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
        """Warm up, capture and check the per-layer graphs; the cache is left empty.

        Raises:
            GraphsUnavailable: the cache or an op of the step cannot be captured, or the replay differs
                from the eager step; nothing captured is kept.
        """
        static_layers_only(self.cache)
        self.pool = torch.cuda.graph_pool_handle()
        try:
            eager = self._record("zeros", "capture", lambda: self._capture_step(self.graphs, self.pool))
            self._check(eager, lambda token: self._replay(token, lambda call: torch.zeros_like(call.hidden)))
        except BaseException:
            self.graphs, self.calls, self.logits, self.pool = [], [], None, None
            raise

    @torch.inference_mode()
    def capture_whole(self, resident: Any) -> None:
        """With every expert in the GPU tier (`resident`: a ResidentExperts), capture the whole step,
        experts included, as one graph and check it against the same step run eagerly, bit for bit.

        Raises:
            GraphsUnavailable: the step cannot be captured so, or the replay differs; the per-layer
                graphs stay in use.
        """
        self.drop_whole()
        self.resident = resident
        whole: list[torch.cuda.CUDAGraph] = []
        try:
            # a pool of its own: it is replayed between the per-layer graphs' steps, not in their order
            eager = self._record(
                "inline", "inline", lambda: self._capture_step(whole, torch.cuda.graph_pool_handle())
            )
            self._check(eager, self._replay_whole)
        except BaseException:
            self.drop_whole()
            raise

    def drop_whole(self) -> None:
        """Forget the one-graph step (its tables and slot buffer belong to a tier about to change)."""
        self.resident = self.whole = self.whole_logits = None

    def _record(self, warm: str, mode: str, capture: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
        """On a side stream, the experts answered by a splitter in mode `warm`: the eager steps (the
        warm-up: allocations, kernel choices, compiling; and the check's oracle), then `capture()` in
        mode `mode`. Returns the eager logits."""
        splitter = _Splitter(self)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._standing_in(splitter):
            with torch.cuda.stream(stream):
                splitter.mode = warm
                eager = self._eager_steps()
                self.cache.reset()
                torch.cuda.synchronize(self.device)
                splitter.mode = mode
                capture()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        return eager

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

    def _capture_step(self, graphs: list[torch.cuda.CUDAGraph], pool: Any) -> torch.Tensor:
        """Capture the step into a new graph of `graphs` (the splitter may end it and begin more);
        returns the logits tensor the last graph writes."""
        self.begin(graphs, pool)
        try:
            logits = self.forward(self.ids)
        except BaseException as exc:
            if graphs and torch.cuda.is_current_stream_capturing():  # leave capture mode to stay usable
                with contextlib.suppress(RuntimeError):  # an invalidated capture ends with an error
                    graphs[-1].capture_end()
            if isinstance(exc, Exception):
                raise GraphsUnavailable(
                    f"the decode step cannot be captured ({type(exc).__name__}: {exc})"
                ) from exc
            raise
        graphs[-1].capture_end()
        if graphs is self.graphs:
            self.logits = logits
            if not self.calls:
                raise GraphsUnavailable("the decode step called no streamed experts")
        else:
            self.whole, self.whole_logits = graphs[0], logits
        return logits

    def _check(self, eager: list[torch.Tensor], replay: Callable[[int], torch.Tensor]) -> None:
        """Replay positions 0 and 1 against the eager steps: the same bits."""
        self.cache.reset()
        try:
            for position, (token, want) in enumerate(zip(EAGER_CHECK_TOKENS, eager)):
                got = replay(token)
                if not torch.equal(got, want):
                    diff = (got - want).abs().max().item()
                    raise GraphsUnavailable(
                        f"the captured step differs from the eager one at position {position} (max "
                        f"|diff| {diff:.3g}): something in it depends on the position on the host"
                    )
        finally:
            self.cache.reset()

    def _replay(self, token: int, experts: Experts) -> torch.Tensor:
        self.ids.fill_(token)
        for graph, call in zip(self.graphs, self.calls):
            graph.replay()
            call.out.copy_(experts(call))
        self.graphs[-1].replay()
        assert self.logits is not None
        return self.logits

    def _replay_whole(self, token: int) -> torch.Tensor:
        assert self.whole is not None and self.whole_logits is not None
        self.ids.fill_(token)
        self.whole.replay()
        return self.whole_logits

    def _streamed(self, call: _ExpertsCall) -> torch.Tensor:
        return self.experts.forward(call.layer, call.hidden, call.index, call.weights)

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token after what the cache holds; returns its logits [V] float32 on the host."""
        if self.whole is not None and self.resident.ready():
            logits = self._replay_whole(token)
            self.resident.count()
            return logits.cpu()
        return self._replay(token, self._streamed).cpu()

"""A graph set: the ggml graphs and buffers of one step shape of the ggml runner (`engine/ggml_runner.py`),
T tokens (1 when decoding, up to the runner's chunk per prefill piece, or one token of each of B sequences
decoded together) over an attention span S (positions, a multiple of 256) in the KV-cache slots the step's
sequences hold, and the bytes one takes, known before it is built."""

from __future__ import annotations

import torch

from moestream import ggml
from moestream.ggml import tiled
from moestream.ggml.backend import DeviceMemory
from moestream.ggml.lib import GgmlTensor
from moestream.ggml.net import Arena, Net
from moestream.graphs.layers import LayerGraphs, StepBuffers
from moestream.graphs.moe import Whole
from moestream.graphs.spec import ModelSpec
from moestream.runtime.expert_layers import ExpertTypes


class GraphSet:
    """The graphs and buffers of one step shape (T tokens, span S): graph i computes layer i (i = number
    of layers: the head); `fused[i]`, where it exists, is graph i with the previous layer's experts in
    it, computed from the cache's slots (when every one the step routes to is cached); `whole` is the
    whole step as one graph (every expert of the model cached for good). Each kind is built when first
    used: a step that is one graph never builds the per-layer ones (a new prompt length built them all,
    10-34 ms on 4 layers, and ran none)."""

    def __init__(
        self,
        spec: ModelSpec,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        shape: tuple[int, int],
        experts: int,
        types: dict[int, ExpertTypes],
        threads: int,
        pool: int,
        last: bool = False,
        memory: DeviceMemory | None = None,
        segments: tuple[tuple[int, int], ...] = ((0, 0),),
        device_only: frozenset[str] = frozenset(),
        mixed: bool = False,
        trunk: dict[int, tuple[int, int, int]] | None = None,
    ) -> None:
        """`device_only`: on a backend, the buffers (by `StepBuffers.tensors` name) that only its graphs
        read and write, never copied around a compute (the residual stream between per-layer graphs).
        `mixed`: the `fused` graphs take each expert output from the device or the host (`LayerGraphs`).
        `trunk`: the trunk's matrices read from repacked copies (`LayerGraphs`)."""
        tokens, span = shape
        # `segments`: (first KV-cache row of its slot, tokens) per sequence (`LayerGraphs.segments`)
        self.buf = StepBuffers.make(spec, tokens, span, experts, len(segments))
        self.memory = memory  # a backend's (ggml's CUDA): the graphs compute there, the buffers are io
        self._pinned = None  # the pinned host buffer the step's buffers live in (CUDA)
        if memory is not None:

            def alloc(nbytes: int) -> torch.Tensor:
                block, self._pinned = memory.host_block(nbytes)
                return block

            self.buf.gather(alloc)
            for name, t in self.buf.tensors():
                memory.register(t, "device" if name in device_only else "io", name)
        self.pool = pool
        self.segments = segments
        # a batch's KV views (`LayerGraphs.kv_views`): each built over `segments`' rows, pointed at the
        # rows of `firsts` (`rebase`), so that one set serves any B slots
        self.kv_views: list[tuple[int, int, int]] = []
        self._based: list[int] = []  # each view's data pointer at the rows of segment 0 of its slot
        self._whole_views = (0, 0)  # the whole graph's views: that range of kv_views
        self.firsts = tuple(first for first, _ in segments)
        self.trunk = trunk
        self._build = LayerGraphs(
            spec,
            kv,
            self.buf,
            types,
            last=last,
            segments=segments,
            mixed=mixed,
            kv_views=self.kv_views,
            trunk=trunk,
        )
        self.last = self._build.last  # past the last layer's attention, the last position only
        self.rows = self._build.rows
        self.graphs: list[Net] = []  # once built (`layer_graphs`)
        self.fused: dict[int, Net] = {}
        self.whole: tuple[Whole, Net] | None = None  # the step as one graph, once built
        self.spec, self.kv, self.types, self.threads = spec, kv, types, threads
        self.arena = Arena([])  # one region for every graph built, as large as the largest

    def layer_graphs(self) -> tuple[list[Net], dict[int, Net]]:
        """(graph of each layer and the head, the fused ones), built on first use."""
        if not self.graphs:
            build, graphs, fused = self._build, [], {}
            start = len(self.kv_views)
            try:
                for i in range(len(self.spec.layers) + 1):
                    for with_experts in (False, True) if build.can_fuse(i) else (False,):
                        net = Net(
                            ggml.library(), nodes=max(1024, 2 * self._layer_nodes()), memory=self.memory
                        )
                        if with_experts:
                            fused[i] = net
                        else:
                            graphs.append(net)
                        if i < len(self.spec.layers):
                            net.finish(
                                build.layer(net, self.spec.layers[i], with_experts), self.threads, self.pool
                            )
                        else:
                            net.finish(build.head(net, with_experts), self.threads, self.pool)
            except BaseException:
                for net in [*graphs, *fused.values()]:
                    net.close()
                del self.kv_views[start:]
                raise
            self.graphs, self.fused = graphs, fused
            self._place()
        return self.graphs, self.fused

    def whole_graph(self, whole: Whole) -> Net:
        """The step as one graph over the slots `whole` names (built on first use, and again when the
        slots move)."""
        if self.whole is None or self.whole[0] != whole:
            self.drop_whole()
            nodes = max(1024, self._layer_nodes() * (len(self.spec.layers) + 1))
            start = len(self.kv_views)  # its views from here on (dropped with it)
            net = Net(ggml.library(), nodes=nodes, memory=self.memory)
            try:
                net.finish(
                    LayerGraphs(
                        self.spec,
                        self.kv,
                        self.buf,
                        self.types,
                        whole,
                        self.last,
                        self.segments,
                        kv_views=self.kv_views,
                        trunk=self.trunk,
                    ).step(net),
                    self.threads,
                    self.pool,
                )
            except BaseException:
                net.close()
                del self.kv_views[start:]
                raise
            # on a device its nodes change only where `_place` places them: replayed unchecked between
            net.replayed = self.memory is not None
            self.whole, self._whole_views = (whole, net), (start, len(self.kv_views))
            self._place()
        return self.whole[1]

    def _layer_nodes(self) -> int:
        """Nodes a layer's graph may take: a batch's attention has a few for each sequence (its flash
        attention, its views; 6 a layer seen), and its routed experts in groups (`LayerGraphs.routed`)
        each group's products and sum (2 K + 13 seen)."""
        batch = len(self.segments)
        groups = len(tiled.row_groups(self.buf.tokens.numel())) if batch > 1 else 1
        return 128 + 10 * (batch - 1) + (groups - 1) * (2 * self.spec.top_k + 16)

    def _place(self) -> None:
        """One scratch and work region for every graph built (they run one at a time)."""
        whole = [self.whole[1]] if self.whole is not None else []
        self.arena.close()
        self.arena = Arena([*self.graphs, *self.fused.values(), *whole], self.memory)
        self._aim(len(self._based))  # the views just built: at `firsts`' rows

    def rebase(self, firsts: tuple[int, ...]) -> None:
        """A batch's sequences now in the slots whose first KV-cache rows are `firsts` (one per segment,
        in the step's order): every graph's keys and values views read those rows (a host set's data
        pointers, as ggml's CPU backend reads them; nothing else in the graphs depends on the slot)."""
        if len(firsts) != len(self.segments):
            raise ValueError(f"{len(firsts)} slots for a set of {len(self.segments)} sequences")
        if firsts != self.firsts:
            self.firsts = firsts
            self._aim(0)

    def _aim(self, start: int) -> None:
        """Point the views from `start` on at `firsts`' rows."""
        for i, (t, segment, row) in enumerate(self.kv_views):
            view = GgmlTensor.from_address(t)
            if i >= len(self._based):
                self._based.append(view.data - self.segments[segment][0] * row)
            if i >= start:
                view.data = self._based[i] + self.firsts[segment] * row

    def drop_whole(self) -> None:
        if self.whole is not None:
            self.whole[1].close()
            self.whole = None
        start, end = self._whole_views
        del self.kv_views[start:end], self._based[start:end]
        self._whole_views = (0, 0)

    def close(self) -> None:
        self.drop_whole()
        for net in [*self.graphs, *self.fused.values()]:
            net.close()
        self.graphs, self.fused = [], {}
        self.arena.close()
        if self.memory is not None:
            for _, t in self.buf.tensors():
                self.memory.drop(t)
            if self._pinned is not None:
                self.buf = None  # its tensors view the pinned buffer
                self._pinned.free()
            self.memory = None


def set_bytes(
    spec: ModelSpec, kv: list, tokens: int, span: int, experts: int, inter: int, threads: int
) -> int:
    """Bytes of one graph set of `tokens` x `span`, laid out as `GraphSet` lays it out over meta tensors
    (nothing is allocated): the largest graph's scratch and work, the step's buffers, and what a fused
    graph adds for the routed experts (`inter`: their intermediate size; gate, up and SwiGLU [I, K, T],
    down [H, K, T], f32; the whole step's graph, its scratch shared by liveness, stays within these, but
    for the argmax's check on a backend: [V] f32, `LayerGraphs.greedy`)."""
    with torch.device("meta"):
        buf = StepBuffers.make(spec, tokens, span, experts)
    build = LayerGraphs(spec, kv, buf)
    pool = ggml.kernels(threads).pool
    scratch = work = 0
    for i in range(len(spec.layers) + 1):
        net = Net(ggml.library())
        try:
            outputs = build.layer(net, spec.layers[i]) if i < len(spec.layers) else build.head(net)
            net.finish(outputs, threads, pool)
            scratch, work = max(scratch, net.scratch_bytes), max(work, net.work_bytes)
        finally:
            net.close()
    moe = any(layer.router is not None for layer in spec.layers)
    fused = 4 * spec.top_k * tokens * (3 * inter + spec.hidden) if moe else 0
    check = 4 * spec.vocab
    return scratch + work + fused + check + sum(t.nbytes for _, t in buf.tensors())

"""A GPU tier's misses computed by ggml's CPU backend from the host cache's slots (`--gpu-tier`,
MOESTREAM_TIER_MISSES=host): one small CPU graph per MoE layer and number of (token, k) pairs, the
layer's misses as one ggml_mul_mat_id per matrix kind over the host size class's slots (ids = host
slots), as llama.cpp's `--n-cpu-moe` computes a layer's experts on the CPU, instead of the expert
runtime's graph per expert.

Each pair is one column: its token's input [H], its expert's host slot, its expert id (gpt-oss's bias
rows); the graph gives each pair's output [H], not yet weighted (the device's graph weighs and sums
them with the hits'). Pairs are padded to a power of two (repeating the first one) so that a layer
builds a few graphs, not one per count; a column's bits do not depend on the others (ggml's CPU
mul_mat_id quantizes and multiplies each column alone), so padding changes nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from moestream import ggml
from moestream.ggml.net import F32, I32, Arena, Net
from moestream.graphs.moe import cached_experts
from moestream.runtime.expert_layers import ExpertTypes


def bucket(pairs: int) -> int:
    """The graph's columns for `pairs` pairs: the next power of two."""
    return 1 << max(0, pairs - 1).bit_length()


class _Buffers:
    """The host buffers a graph of `columns` pairs reads and writes: one set per column count, shared by
    every layer's graph of that count (the graphs run one at a time and `compute`'s output is a view valid
    until the next compute), so that host memory grows with the buckets used, not with layers x buckets."""

    def __init__(self, hidden: int, columns: int) -> None:
        self.x = torch.zeros(columns, hidden, dtype=torch.float32)
        self.slots = torch.zeros(columns, dtype=torch.int32)
        self.experts = torch.zeros(columns, dtype=torch.int32)
        self.out = torch.zeros(columns, hidden, dtype=torch.float32)


class _Graph:
    """One layer's graph of `columns` pairs over the buffers of that count."""

    def __init__(self, types: ExpertTypes, buffers: _Buffers, threads: int, pool: int) -> None:
        self.x, self.slots, self.experts, self.out = buffers.x, buffers.slots, buffers.experts, buffers.out
        P, H = self.x.shape
        self.net = Net(ggml.library(), nodes=64)
        try:
            net = self.net
            x = net.tensor(F32, [H, 1, P], self.x.data_ptr())
            ids = net.tensor(I32, [1, P], self.slots.data_ptr())
            experts = net.tensor(I32, [1, P], self.experts.data_ptr())
            y = cached_experts(net, types, H, x, ids, 0, experts)  # [H, 1, P]
            net.finish([net.fix(y, self.out.data_ptr())], threads, pool)
        except BaseException:
            self.net.close()
            raise


class HostMisses:
    """The CPU graphs of one runner's GPU tier misses, on ggml's compute pool of `threads`."""

    def __init__(self, types: dict[int, ExpertTypes], hidden: int, threads: int) -> None:
        self.types, self.hidden, self.threads = types, hidden, threads
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._buffers: dict[int, _Buffers] = {}  # by column count
        self._arena: Arena | None = None
        self._pool = 0

    def compute(
        self, layer: int, source: np.ndarray, tokens: np.ndarray, slots: list[int], experts: list[int]
    ) -> np.ndarray:
        """Each pair's output [P, H] (a view, valid until the next compute): pair p's input is row
        tokens[p] of `source` [T, H] f32, its expert's host slot in `layer`'s size class slots[p], its
        expert id experts[p]. The caller holds the pool's lock (`ggml.kernels(threads)._lock`) and keeps
        the slots pinned meanwhile."""
        P = len(slots)
        kern = ggml.kernels(self.threads)
        g = self._graph(layer, bucket(P), kern.pool)
        x = g.x.numpy()
        np.take(source, tokens, axis=0, out=x[:P])
        g.slots.numpy()[:P] = slots
        g.experts.numpy()[:P] = experts
        if len(g.slots) > P:  # padding: the first pair again (its columns are not read)
            x[P:] = x[0]
            g.slots.numpy()[P:] = slots[0]
            g.experts.numpy()[P:] = experts[0]
        g.net.run()
        kern.idle()
        return g.out.numpy()[:P]

    def _graph(self, layer: int, columns: int, pool: int) -> _Graph:
        if pool != self._pool:  # the pool was replaced (another thread count): plans for the old one
            self.close()
            self._pool = pool
        g = self._graphs.get((layer, columns))
        if g is None:
            buffers = self._buffers.get(columns)
            if buffers is None:
                buffers = self._buffers[columns] = _Buffers(self.hidden, columns)
            g = _Graph(self.types[layer], buffers, self.threads, pool)
            self._graphs[(layer, columns)] = g
            if self._arena is not None:
                self._arena.close()
            # one scratch and work region for every graph (they run one at a time), placed again
            self._arena = Arena([x.net for x in self._graphs.values()])
        return g

    def close(self) -> None:
        for g in self._graphs.values():
            g.net.close()
        self._graphs = {}
        self._buffers = {}
        if self._arena is not None:
            self._arena.close()
            self._arena = None

"""ggml graphs built by moestream (a model's layers), with every tensor placed before the first run.

A `Net` is one ggml context holding one graph. Its tensors are of two kinds:

- fixed: their data is at an address given when they are made (weights, the KV cache, the expert
  cache's slots, the buffers a runner fills or reads between graphs: the residual stream, the router's
  output, the experts' slots or outputs, the logits);
- scratch: every other result, placed back to back in an `Arena` that all graphs of one set share:
  they run one at a time and leave nothing for later in scratch, so one region serves them all.

Views (reshape, permute, view, the results of set_rows and cpy) take their data from their source at
placement. Nothing is allocated or written per run: `run` computes.

On a backend (`memory`: a `ggml.backend.DeviceMemory`, e.g. ggml's CUDA), the same graph is built from
the same host addresses: each fixed tensor is placed at the device copy of its host region (`translate`),
the scratch in a device buffer, and `run` copies the `io` regions' bytes the graph reads to the device
before computing and the bytes it writes back after (the step's inputs and outputs; weights and the KV
cache stay on the device). A result marked `on_demand` (the logits) may be left on the device by
`run(fetch=False)`, which copies back its stand-ins instead (their argmax), and `fetch` copies it when
asked.
"""

from __future__ import annotations

import bisect
import ctypes as C
import itertools
import os
from collections.abc import Sequence

import torch

from moestream.ggml.backend import DeviceMemory, Region, place_tensor
from moestream.ggml.graphs import compute_graph, free_context
from moestream.ggml.lib import GgmlGraph, GgmlTensor, GgmlUnavailableError, InitParams, Library

F32, F16, I32, I64, BF16 = 0, 1, 26, 27, 30  # GGML_TYPE_*
FLOAT_TYPES = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}  # a float tensor's type
SORT_DESC = 1  # GGML_SORT_ORDER_DESC
ROPE_NEOX = 2  # GGML_ROPE_TYPE_NEOX: rotate_half, transformers' Llama-style rotary
_ALIGN = 64
# the graphs' uids (`Net._renew_uid`): apart from ggml's own (its scheduler counts from 1)
_FIRST_UID = 1 << 62
_UIDS = itertools.count(_FIRST_UID)
# every node its own scratch bytes, none reused after its last reader (debugging: a node's output then
# stays readable after the compute, benchmarks/cuda_graph_bisect.py)
_REUSE = os.environ.get("MOESTREAM_GGML_SCRATCH_REUSE", "1") != "0"
# a tensor's bytes are reused only this many nodes after its last reader: ggml's backends fuse runs of
# consecutive nodes into one kernel (ggml's CUDA: norm+mul+rope, the router's top-k, gate+up+GLU, the
# experts' weighted sum: up to 2 K + 1 nodes, K <= 15) and compute such a run only where its output
# does not overlap an input of the run (`ggml_cuda_check_fusion_memory_ranges`; ggml's scheduler keeps
# such inputs alive for the fusions it allows, "alloc deps"): freed at the last reader, an input's bytes
# went to the run's output and the fusion was refused
FUSE_WINDOW = 32
# on a backend, how flash attention gets its query (see `Net.query`): "copy" (the default) a contiguous
# copy; "view" the permuted view, as on the CPU and as llama.cpp does (12-06 on the H100: the copy's 3.3%
# of a decoded token saved, the greedy tokens off the CPU graphs' from the second); "reshape" a one-token
# query as the contiguous tensor the copy would make, without copying (a longer one copied): for measuring
_QUERY = os.environ.get("MOESTREAM_GGML_QUERY", "copy").strip()


class Net:
    """One graph under construction, then planned and placed; `run()` computes it."""

    # a backend's graph whose nodes change only where it is placed (`place`; GraphSet's whole step on a
    # device): each placement gives it a fresh uid (`_renew_uid`), and ggml's CUDA backend then compares
    # its nodes with the CUDA graph it keeps once, on the run after, instead of on every run (1450 nodes
    # a step of 24 layers)
    replayed = False

    def __init__(self, lib: Library, nodes: int = 1024, memory: DeviceMemory | None = None) -> None:
        self.lib = lib
        self.memory = memory
        self._inputs: list[tuple[Region, int, int]] = []  # io bytes the graph reads: (region, offset, n)
        self._outputs: list[tuple[Region, int, int]] = []  # ... and writes
        self._later: list[tuple[Region, int, int]] = []  # ... and writes, copied back on demand
        self._instead: list[tuple[Region, int, int]] = []  # ... and writes, copied back in their place
        self._on_demand: dict[int, bool] = {}  # fixed results `run` copies back as `fetch` says: stand-in?
        b = lib.base
        mem = 4 * nodes * b.ggml_tensor_overhead() + b.ggml_graph_overhead_custom(nodes, False)
        self.ctx = b.ggml_init(InitParams(mem, None, True))
        if not self.ctx:
            raise RuntimeError("ggml_init failed")
        self.nodes = nodes
        self._io: list[tuple[int, Region, int, int]] = []  # fixed tensors in io regions
        self._host: dict[int, int] = {}  # on a backend: fixed tensor -> its host address
        self.fixed: set[int] = set()
        self.gf = 0
        self.scratch_bytes = self.work_bytes = 0
        self._layout: list[tuple[GgmlTensor, int]] = []  # scratch tensors and their offsets
        self._views: list[GgmlTensor] = []  # views of scratch tensors, in graph order
        self._plan = None

    # --- building ------------------------------------------------------------------------------

    def tensor(self, type_id: int, ne: Sequence[int], address: int | None = None) -> int:
        """A leaf of shape ne (ne[0] contiguous), fixed at `address` (or later by `fix`)."""
        b, n = self.lib.base, len(ne)
        if n == 1:
            t = b.ggml_new_tensor_1d(self.ctx, type_id, ne[0])
        elif n == 2:
            t = b.ggml_new_tensor_2d(self.ctx, type_id, ne[0], ne[1])
        elif n == 3:
            t = b.ggml_new_tensor_3d(self.ctx, type_id, ne[0], ne[1], ne[2])
        else:
            t = b.ggml_new_tensor_4d(self.ctx, type_id, *ne)
        if address is not None:
            self.fix(t, address)
        return t

    def weight(self, w: torch.Tensor | tuple[int, int], ne: Sequence[int]) -> int:
        """A fixed leaf over a weight: a contiguous float tensor (F32/F16/BF16), or (address, ggml type)."""
        if isinstance(w, torch.Tensor):
            if not w.is_contiguous() or w.device.type != "cpu":
                raise ValueError("a ggml weight must be a contiguous CPU tensor")
            type_id = FLOAT_TYPES[w.dtype]
            return self.tensor(type_id, ne, w.data_ptr())
        address, type_id = w
        return self.tensor(type_id, ne, address)

    def fix(self, t: int, address: int) -> int:
        """Give tensor t (a leaf, or a result that must outlive the graph) the memory at `address` (on a
        backend, the device copy of the host region there)."""
        if self.memory is None:
            GgmlTensor.from_address(t).data = address
        else:  # placed in `finish`, once its strides are final (a builder may set nb after making it)
            self._host[t] = address
        self.fixed.add(t)
        return t

    def on_demand(self, t: int, stand_in: bool = False) -> int:
        """Mark the fixed result t as one that `run(fetch=False)` leaves on the device (a backend's) and
        `fetch` copies back; `stand_in`: one copied back by that run alone (the argmax of logits left
        there), the others making it needless."""
        if t not in self.fixed:
            raise ValueError("only a fixed result is copied back on demand")
        self._on_demand[t] = stand_in
        return t

    def _translate(self) -> None:
        """Each fixed tensor at the device copy of its host bytes (as many as its strides reach)."""
        for t, address in self._host.items():
            nbytes = self.lib.base.ggml_nbytes(t)
            device, buffer, region = self.memory.translate(address, nbytes)
            place_tensor(t, device, buffer)
            if region.role == "io":  # a leaf is read by the graph, a result written (see `finish`)
                self._io.append((t, region, device - region.device, nbytes))

    def query(self, q: int) -> int:
        """The query of a flash attention, q [D, N, T] as [D, T, N]: a permuted view on the CPU, a
        contiguous copy on a backend (ggml's CUDA graphs, replayed, computed flash attention over the
        permuted view otherwise than launched one by one: wrong tokens; found 2026-12-04 on the H200 by
        benchmarks/cuda_graph_bisect.py; the copy is D x N x T floats)."""
        t = GgmlTensor.from_address(q)
        if self.memory is not None and _QUERY == "reshape" and t.ne[2] == 1:
            # one token: [D, N, 1] and its permutation [D, 1, N] hold the same bytes in the same order,
            # the copy's layout (this view's strides are the copy's)
            return self.reshape_3d(q, t.ne[0], 1, t.ne[1])
        q = self.permute(q, 0, 2, 1, 3)
        return q if self.memory is None or _QUERY == "view" else self.cont(q)

    @staticmethod
    def check_query_mode() -> None:
        """Refuse a MOESTREAM_GGML_QUERY of none of the three ways (a runner on a backend asks at load).

        Raises:
            GgmlUnavailableError: the variable says something else.
        """
        if _QUERY not in ("copy", "view", "reshape"):
            raise GgmlUnavailableError(f"MOESTREAM_GGML_QUERY={_QUERY!r}: say copy, view or reshape")

    def __getattr__(self, name: str):
        """net.mul_mat(a, b), net.rms_norm(x, eps), ...: ggml_<name>(ctx, ...)."""
        fn = getattr(self.lib.base, f"ggml_{name}")

        def op(*args):
            t = fn(self.ctx, *args)
            if not t:
                raise RuntimeError(f"ggml_{name} returned NULL")
            return t

        return op

    # --- planning and placement ----------------------------------------------------------------

    def finish(self, outputs: Sequence[int], n_threads: int, pool: int) -> None:
        """Build the graph of `outputs` (in this order: a KV-cache write listed before the attention
        that reads the cache runs before it), lay out its scratch, plan it for `pool`."""
        b = self.lib.base
        if self.memory is not None:
            self._translate()
        self.gf = b.ggml_new_graph_custom(self.ctx, self.nodes, False)
        for out in outputs:
            b.ggml_build_forward_expand(self.gf, out)
        nodes = [b.ggml_graph_node(self.gf, i) for i in range(b.ggml_graph_n_nodes(self.gf))]
        last = _last_uses(nodes)
        space = _Space()
        offsets: dict[int, int] = {}
        for i, ptr in enumerate(nodes):
            # nodes run one after another: what no node from FUSE_WINDOW nodes back on reads gives its
            # bytes back now (before this node takes its own)
            for dead in last.pop(i - FUSE_WINDOW, ()):
                if dead in offsets and _REUSE:
                    space.give(offsets[dead], (b.ggml_nbytes(dead) + _ALIGN - 1) // _ALIGN * _ALIGN)
            t = GgmlTensor.from_address(ptr)
            if ptr not in self.fixed:
                if t.view_src:
                    self._views.append(t)  # its source is placed above (it comes first in the graph)
                else:
                    offsets[ptr] = space.take((b.ggml_nbytes(ptr) + _ALIGN - 1) // _ALIGN * _ALIGN)
                    self._layout.append((t, offsets[ptr]))
        self.scratch_bytes = space.top
        if self.memory is not None:
            self._on_backend(nodes)
            return
        self._plan = self.lib.cpu.ggml_graph_plan(self.gf, n_threads, pool)
        if self._plan.threadpool != pool:
            raise RuntimeError("ggml_graph_plan returned a plan for another threadpool")
        self.work_bytes = self._plan.work_size

    def _on_backend(self, nodes: list[int]) -> None:
        """Refuse an op the backend lacks (one sentence, not ggml's abort mid-compute); sort the io
        tensors into what the graph reads (leaves, before) and writes (results, after)."""
        backend = self.memory.backend
        for ptr in nodes:
            if not backend.supports(ptr):
                op = self.lib.base.ggml_op_name(GgmlTensor.from_address(ptr).op).decode()
                raise GgmlUnavailableError(f"ggml's {backend.kind} backend cannot compute {op} here")
        for t, region, offset, nbytes in self._io:
            written = GgmlTensor.from_address(t).op != 0  # a result, not a leaf (GGML_OP_NONE)
            if not written:
                copies = self._inputs
            elif t in self._on_demand:
                copies = self._instead if self._on_demand[t] else self._later
            else:
                copies = self._outputs
            copies.append((region, offset, nbytes))
        self._inputs, self._outputs = _coalesce(self._inputs), _coalesce(self._outputs)
        self._later, self._instead = _coalesce(self._later), _coalesce(self._instead)

    def place(self, scratch: int, work: int, buffer: int = 0) -> None:
        """Put the scratch tensors at `scratch` (scratch_bytes long) and the plan's work buffer at `work`
        (on a backend: `scratch` in its buffer `buffer`, no work buffer)."""
        for t, offset in self._layout:
            t.data = scratch + offset
            t.buffer = buffer or t.buffer
        for v in self._views:
            src = GgmlTensor.from_address(v.view_src)
            v.data = src.data + v.view_offs
            v.buffer = src.buffer
        if self.memory is None:
            self._plan.work_data = work
            self._plan_ref = C.byref(self._plan)
        elif self.replayed:
            self._renew_uid()

    def _renew_uid(self) -> None:
        """Give the graph a uid no graph had (ggml's `ggml_cgraph.uid`, which its CUDA backend compares
        with the one it last ran under the same key, `ggml_cuda_graph_update_required`), where the library
        lays the graph out as `GgmlGraph` reads it: its node array right after the struct, its counts and
        first and last nodes as the API gives them, and no uid but one of ours; else none (every run's
        nodes compared, as without)."""
        b, gf = self.lib.base, self.gf
        g = GgmlGraph.from_address(gf)
        n = b.ggml_graph_n_nodes(gf)
        known = (
            n > 0
            and g.size == self.nodes
            and g.n_nodes == n
            and g.nodes == gf + C.sizeof(GgmlGraph)
            and C.c_void_p.from_address(g.nodes).value == b.ggml_graph_node(gf, 0)
            and C.c_void_p.from_address(g.nodes + C.sizeof(C.c_void_p) * (n - 1)).value
            == b.ggml_graph_node(gf, n - 1)
            and g.hash_size >= g.size
            and (g.uid == 0 or g.uid >= _FIRST_UID)
        )
        if known:
            g.uid = next(_UIDS)

    def run(self, fetch: bool = True) -> None:
        """Compute (the caller holds the pool's lock); on a backend, with the io bytes copied around it:
        the `on_demand` results' where `fetch`, else their stand-ins' (`fetch()` copies them later, before
        the next run)."""
        if self.memory is None:
            compute_graph(self.lib, self.gf, self._plan_ref)
            return
        self.launch(fetch)
        self.memory.backend.synchronize()

    def launch(self, fetch: bool = True) -> None:
        """`run` on a backend without waiting for it: its copies and compute queued on the backend's
        stream; the backend's `synchronize` ends it (before the results are read or the inputs written)."""
        memory = self.memory
        for region, offset, nbytes in self._inputs:
            memory.upload(region, offset, nbytes)
        memory.backend.compute_async(self.gf)
        for region, offset, nbytes in self._outputs:
            memory.download(region, offset, nbytes)
        for region, offset, nbytes in self._later if fetch else self._instead:
            memory.download(region, offset, nbytes)

    def fetch(self) -> None:
        """Copy back the `on_demand` results the last `run(fetch=False)` left on the device (on the CPU
        every result is in place: nothing to do)."""
        if self.memory is None:
            return
        for region, offset, nbytes in self._later:
            self.memory.download(region, offset, nbytes)
        self.memory.backend.synchronize()

    def close(self) -> None:
        self.ctx = free_context(self.lib, self.ctx)


def _coalesce(copies: list[tuple[Region, int, int]]) -> list[tuple[Region, int, int]]:
    """One copy per run of overlapping or touching byte ranges of a region (each layer's set_rows reads
    the step's rows: one upload, not one a layer; each layer's routing written into its slice of one
    buffer: one download). Ranges with a gap between them stay apart: the gap's bytes are not the graph's."""
    merged: list[tuple[Region, int, int]] = []
    for region, offset, nbytes in sorted(copies, key=lambda c: (id(c[0]), c[1])):
        if merged and merged[-1][0] is region and offset <= merged[-1][1] + merged[-1][2]:
            start = merged[-1][1]
            merged[-1] = (region, start, max(merged[-1][1] + merged[-1][2], offset + nbytes) - start)
        else:
            merged.append((region, offset, nbytes))
    return merged


def _root(ptr: int) -> int:
    """The tensor whose memory `ptr` uses (itself, or the source at the end of its chain of views)."""
    t = GgmlTensor.from_address(ptr)
    while t.view_src:
        ptr = t.view_src
        t = GgmlTensor.from_address(ptr)
    return ptr


def _last_uses(nodes: list[int]) -> dict[int, list[int]]:
    """node index -> the tensors (by the memory they own) that no node after it reads: a tensor lives
    until the last node that reads it, or a view of it, has run (or until it is made, if none does)."""
    last: dict[int, int] = {}
    for i, ptr in enumerate(nodes):
        last[_root(ptr)] = i
        for src in GgmlTensor.from_address(ptr).src:
            if src:
                last[_root(src)] = i
    by_node: dict[int, list[int]] = {}
    for ptr, i in last.items():
        by_node.setdefault(i, []).append(ptr)
    return by_node


class _Space:
    """Offsets in one scratch region: blocks taken and given back (best fit among the free blocks, else
    the top grows), so tensors that never live at once share bytes, as ggml-alloc lays out a graph."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (offset, size), by offset, never adjacent
        self.top = 0

    def take(self, size: int) -> int:
        fits = [(n, k) for k, (_, n) in enumerate(self.free) if n >= size]
        if fits:
            n, k = min(fits)
            offset = self.free[k][0]
            if n == size:
                del self.free[k]
            else:
                self.free[k] = (offset + size, n - size)
            return offset
        if self.free and self.free[-1][0] + self.free[-1][1] == self.top:  # a free block at the top
            offset = self.free.pop()[0]
        else:
            offset = self.top
        self.top = max(self.top, offset + size)
        return offset

    def give(self, offset: int, size: int) -> None:
        k = bisect.bisect(self.free, (offset, size))
        self.free.insert(k, (offset, size))
        if k + 1 < len(self.free) and offset + size == self.free[k + 1][0]:  # merge with the next
            self.free[k] = (offset, size + self.free.pop(k + 1)[1])
        if k > 0 and self.free[k - 1][0] + self.free[k - 1][1] == offset:  # and with the previous
            prev = self.free[k - 1][0]
            self.free[k - 1] = (prev, self.free[k - 1][1] + self.free.pop(k)[1])


class Arena:
    """Scratch and work memory for a set of graphs that run one at a time (on a backend: scratch in a
    buffer of its device, `memory`'s)."""

    def __init__(self, nets: Sequence[Net], memory: DeviceMemory | None = None) -> None:
        scratch = max([n.scratch_bytes for n in nets] + [_ALIGN])
        self.buffer = None
        if memory is not None:
            self.buffer = memory.backend.alloc(scratch)
            self.scratch = self.work = torch.empty(0, dtype=torch.uint8)
            for n in nets:
                n.place(self.buffer.base, 0, self.buffer.handle)
            return
        self.scratch = torch.empty(scratch, dtype=torch.uint8)
        self.work = torch.empty(max([n.work_bytes for n in nets] + [_ALIGN]), dtype=torch.uint8)
        for n in nets:
            n.place(self.scratch.data_ptr(), self.work.data_ptr())

    @property
    def nbytes(self) -> int:
        device = self.buffer.size if self.buffer is not None else 0
        return self.scratch.numel() + self.work.numel() + device

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.free()
            self.buffer = None

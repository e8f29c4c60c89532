"""The CPU path's decode steps on ggml's repacked kernels (MOESTREAM_GGML_REPACK=1, experimental).

llama.cpp keeps its CPU weights in ggml's repacked layout (`ggml/repack.py`); on 2 cores that is its lead
at several streams (BENCHMARKS: a MoE layer's products 1.39x faster at 4 tokens, 1.77-2.02x at 16, and
slower at a 256-token chunk). Here the expert cache's slots keep the blocks as stored (the expert runtime,
a GPU tier and the cache's reads use them as such) and, once every expert is in its slot for good
(`ExpertLayers.resident_slots`), each layer's experts are copied once into a repack buffer in that
layout, matrix by matrix, for the kinds whose type has repacked kernels (on x86 with AVX2: Q4_K, Q4_0,
Q2_K, IQ4_NL, MXFP4; the others, Q6_K and Q8_0 among them, stay on the slots). The graph sets of steps
of at most `REPACK_ROWS` tokens (a decoded token, a batch's rows, a short prompt chunk) compute those
kinds from the copy; longer chunks from the slots. The copy takes as much memory again as those kinds'
matrices: that is the cost of the switch, and why it is not the default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from moestream import ggml
from moestream.ggml.net import FLOAT_TYPES, Net
from moestream.ggml.repack import Repacker
from moestream.ggml.types import UnsupportedTypeError
from moestream.graphs.parts import Matrix
from moestream.runtime.expert_layers import ExpertTypes, SlotArena
from moestream.store.experts import ExpertMap

REPACK_ROWS = 64  # steps of up to this many tokens compute from the repacked copy


class RepackedExperts:
    """The repacked copies of one expert streaming's experts while each is in its slot for good (`types`:
    `ExpertLayers.graph_types()`; `first`: each MoE layer's slot of its expert 0, expert e in slot
    first + e, `ExpertLayers.resident_slots()`; `experts` a layer); `types` as the graphs see them over
    the copies. Freed by `close`, after the graph sets built over them."""

    def __init__(
        self, types: dict[int, ExpertTypes], first: dict[int, int], experts: int, hidden: int
    ) -> None:
        lib = ggml.library()
        self.repacker = Repacker(lib)
        self.nbytes = 0
        self.kinds: set[str] = set()  # the matrix kinds repacked somewhere
        # a context for the matrices' leaves while they are written (a leaf a kind a layer)
        net = Net(lib, nodes=3 * len(types) + 8)
        try:
            self.types: dict[int, ExpertTypes] = {}
            with self.repacker.quiet():
                for layer, t in types.items():
                    arena = t.arena
                    if arena is not None and layer in first:
                        arena = self._copy(net, t, arena, first[layer], experts, hidden)
                    self.types[layer] = dataclasses.replace(t, arena=arena)
        except BaseException:
            self.repacker.close()
            raise
        finally:
            net.close()

    def _copy(
        self, net: Net, t: ExpertTypes, a: SlotArena, first: int, experts: int, hidden: int
    ) -> SlotArena:
        """A layer's `experts` experts (slots `first` on) of each kind that has repacked kernels, in a
        repack buffer of that kind's matrices back to back, written matrix by matrix; the arena over
        them: expert e's matrix of such a kind at the copy's address + (first + e) matrices (its stride),
        the other kinds' at the slots'."""
        address, strides, marks = dict(a.address), {k: a.stride(k) for k in a.address}, {}
        for kind, (type_id, cols, rows) in t.shapes(hidden).items():
            if kind not in a.address:
                continue
            sources = [a.address[kind] + (first + e) * a.stride(kind) for e in range(experts)]
            copied = self.repacker.copy(net.tensor(type_id, [cols, rows]), sources)
            if copied is None:  # no repacked kernels for this type: the slots' blocks
                continue
            handle, base, size, extra = copied
            address[kind], strides[kind], marks[kind] = base - first * size, size, (handle, extra)
            self.kinds.add(kind)
            self.nbytes += experts * size
        if not marks:
            return a
        return dataclasses.replace(a, address=address, slots=first + experts, strides=strides, repacked=marks)

    def close(self) -> None:
        self.repacker.close()


def trunk_matrices(obj: object) -> Iterator[Matrix]:
    """Every `Matrix` of a model spec (its layers' attention, dense MLPs, shared experts, routers; the
    head), found through its dataclasses, lists, tuples and dicts."""
    if isinstance(obj, Matrix):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from trunk_matrices(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from trunk_matrices(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from trunk_matrices(x)


def block_matrices(matrices: Iterator[Matrix]) -> dict[int, Matrix]:
    """The block-quantized ones (not float) of `matrices`, each once: address -> matrix (a tied head is
    the embedding's)."""
    floats = set(FLOAT_TYPES.values())
    return {m.address: m for m in matrices if m.type_id not in floats}


class RepackedTrunk:
    """Repacked copies of the trunk's block-quantized matrices whose type has repacked kernels (each
    matrix once, in a buffer of its own): `map` gives a matrix's address -> (its copy's address, the
    copy's ggml buffer, its kernels), what `LayerGraphs` reads for the products of short steps. The trunk
    is locked in memory for the runner's life, so the copies never go stale. Freed by `close`, after the
    graph sets built over them."""

    def __init__(self, matrices: Iterator[Matrix]) -> None:
        lib = ggml.library()
        self.repacker = Repacker(lib)
        self.map: dict[int, tuple[int, int, int]] = {}
        self.nbytes = 0
        todo = block_matrices(matrices)
        net = Net(lib, nodes=len(todo) + 8)
        try:
            with self.repacker.quiet():
                for address, m in todo.items():
                    copied = self.repacker.copy(net.tensor(m.type_id, [m.cols, m.rows]), [address])
                    if copied is None:  # no repacked kernels for this type (or shape): read as stored
                        continue
                    handle, base, size, extra = copied
                    self.map[address] = (base, handle, extra)
                    self.nbytes += size
        except BaseException:
            self.repacker.close()
            raise
        finally:
            net.close()

    def close(self) -> None:
        self.repacker.close()


def copy_bytes(emap: ExpertMap, spec: object) -> int:
    """What MOESTREAM_GGML_REPACK=1's copies will take (`RepackedExperts`, `RepackedTrunk`): the bytes of
    every expert matrix and trunk matrix whose type ggml's CPU backend here has repacked kernels for
    (each repacked layout is as large as the blocks as stored), for the memory plan to keep."""
    kernels: dict[str, bool] = {}
    repacker = Repacker(ggml.library())
    try:

        def has(name: str) -> bool:
            if name not in kernels:
                try:
                    kernels[name] = repacker.has_kernels(ggml.ggml_type(name).id)
                except UnsupportedTypeError:  # a float or a format ggml does not take: never repacked
                    kernels[name] = False
            return kernels[name]

        total = 0
        for (layer, _), unit in emap.units.items():
            for kind, parts in unit.items():
                fmt = emap.formats.get((layer, kind))
                if fmt is not None and has(fmt.name):
                    total += sum(p.nbytes for p in parts)
        for m in block_matrices(trunk_matrices(spec)).values():
            if has(ggml.ggml_type(m.type_id).name):
                total += m.ref.numel() * m.ref.element_size()
        return total
    finally:
        repacker.close()

"""GGML block types streamed through the real cache, reader and runtime (CPU, ggml kernels).

The expert bytes are laid out as a GGUF file lays them out: one [E, rows, K] tensor per (layer, kind),
rows back to back, tensor data 32-byte (not 4096-byte) aligned, a Q4_K_M-like mix (gate/up Q4_K, down
Q6_K in one layer and Q4_K in the other). Oracles: (a) the same ggml kernels applied to the experts' bytes
straight from the file, in ascending expert order: bit for bit; (b) an fp64 SwiGLU over the gguf
package's dequantization of the same bytes, within 3e-2 relative: ggml quantizes the activations to
8 bits (Q8_K blocks of 256) before each product, ~7e-3 per matrix, and an expert chains three.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from moestream import ggml
from moestream.cache.expert_cache import ExpertCache
from moestream.cache.size_classes import budget_requirements
from moestream.io.reader import Reader
from moestream.runtime.experts import ExpertRuntime
from moestream.runtime.families import SwiGLU
from moestream.runtime.formats import make_format
from moestream.runtime.tiers import HostTier
from moestream.store.experts import SWIGLU_KINDS, ExpertMap, StoredFormat
from moestream.store.safetensors_file import TensorRef

H, I, E, LAYERS, K = 256, 256, 8, 2, 2
# a Q4_K_M file's two kinds of layer: down at Q6_K (llama.cpp's use_more_bits layers) or Q4_K
MIX = {(0, "gate"): "Q4_K", (0, "up"): "Q4_K", (0, "down"): "Q6_K"}
MIX |= {(1, "gate"): "Q4_K", (1, "up"): "Q4_K", (1, "down"): "Q4_K"}
SINGLE = ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ4_XS"]
SHAPES = {"gate": (I, H), "up": (I, H), "down": (H, I)}


def write_experts(path, types, seed=0):
    """Write every (layer, kind) as one [E, rows, K] tensor of its type at 32-byte aligned offsets (the
    first one 4096*3 + 96 bytes in); returns the ExpertMap and the file's bytes."""
    g = torch.Generator().manual_seed(seed)
    blob = bytearray(b"\x5a" * (3 * 4096 + 96))
    emap = ExpertMap(family="swiglu", kinds=SWIGLU_KINDS, num_experts=E)
    for layer in range(LAYERS):
        for kind in SWIGLU_KINDS:
            rows, cols = SHAPES[kind]
            name = types[(layer, kind)]
            per = ggml.row_bytes(name, cols) * rows
            for e in range(E):
                data = ggml.quantize(torch.randn(rows, cols, generator=g) * 0.2, name).numpy().tobytes()
                assert len(data) == per
                ref = TensorRef(str(path), len(blob), per, name, (rows, cols), f"blk.{layer}.{kind}[{e}]")
                emap.units.setdefault((layer, e), {})[kind] = (ref,)
                blob += data
            emap.formats[(layer, kind)] = StoredFormat(name)
            blob += b"\x00" * (-len(blob) % 32 + 32)  # the next tensor: 32-aligned, never 4096-aligned
    path.write_bytes(bytes(blob))
    return emap, bytes(blob)


def weight_bytes(blob, ref):
    return torch.frombuffer(bytearray(blob[ref.offset : ref.end]), dtype=torch.uint8).clone()  # aligned


def direct(emap, blob, layer, hidden, index, weights):
    """The same formats (ggml, or dequantize + F.linear above the batch threshold) on the file's bytes,
    experts in ascending order: what streaming must equal."""
    out = torch.zeros_like(hidden)
    for e in sorted(set(index.flatten().tolist())):
        tokens, positions = torch.where(index == e)
        parts = emap.units[(layer, e)]

        def lin(kind, x, parts=parts):
            fmt = make_format(emap.formats[(layer, kind)], parts[kind])
            return fmt.linear(x, weight_bytes(blob, parts[kind][0]))

        x = hidden[tokens]
        h = F.silu(lin("gate", x)) * lin("up", x)
        out.index_add_(0, tokens, lin("down", h) * weights[tokens, positions, None])
    return out


def fp64_reference(emap, blob, layer, hidden, index, weights):
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for e in sorted(set(index.flatten().tolist())):
        tokens, positions = torch.where(index == e)
        w = {}
        for k in SWIGLU_KINDS:
            ref = emap.units[(layer, e)][k][0]
            raw = np.frombuffer(blob[ref.offset : ref.end], dtype=np.uint8).reshape(SHAPES[k][0], -1)
            qtype = GGMLQuantizationType[emap.formats[(layer, k)].name]
            w[k] = torch.from_numpy(gguf_dequantize(raw, qtype)).double()
        x = hidden[tokens].double()
        h = F.silu(x @ w["gate"].T) * (x @ w["up"].T)
        out.index_add_(0, tokens, (h @ w["down"].T) * weights[tokens, positions, None].double())
    return out


class JitteryReader(Reader):
    def __init__(self, *args, seed=0, **kwargs):
        self._rng = random.Random(seed)
        super().__init__(*args, **kwargs)

    def _read(self, request, start):
        time.sleep(self._rng.random() * 0.0003)
        return super()._read(request, start)


def _runtime(emap, budget, reader):
    cache = ExpertCache(emap, budget, reader, top_k=K, piece_bytes=16384, lock_memory=False)
    return ExpertRuntime(cache, HostTier(cache), SwiGLU(F.silu))


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    return write_experts(tmp_path_factory.mktemp("q") / "experts.bin", MIX)


@pytest.fixture(scope="module", params=SINGLE)
def single(request, tmp_path_factory):
    types = {(layer, kind): request.param for layer in range(LAYERS) for kind in SWIGLU_KINDS}
    return write_experts(tmp_path_factory.mktemp(request.param) / "experts.bin", types)


def _inputs(gen, tokens):
    hidden = torch.randn(tokens, H, generator=gen)
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    return hidden, index, torch.rand(tokens, K, generator=gen)


@pytest.mark.parametrize("io_mode,threads", [("direct", 1), ("direct", 4), ("pagecache", 4), ("mmap", 1)])
def test_streamed_quantized_experts_equal_the_kernels_on_the_file(experts, io_mode, threads):
    emap, blob = experts
    minimum, _ = budget_requirements(emap, K)
    slot = minimum // K
    gen = torch.Generator().manual_seed(3)
    for budget in (minimum, 5 * slot, slot * E * LAYERS):
        reader = Reader(io_mode, threads)
        try:
            runtime = _runtime(emap, budget, reader)
            for i in range(12):
                # decode, a small prefill, and ~50 tokens per expert (above the dequantize threshold of
                # the prebuilt library, where one applies)
                layer, tokens = i % LAYERS, (1, 3, 200)[i % 3]
                hidden, index, weights = _inputs(gen, tokens)
                got = runtime.forward(layer, hidden, index, weights)
                assert torch.equal(got, direct(emap, blob, layer, hidden, index, weights)), (budget, i)
        finally:
            reader.close()


def test_every_format_streams_like_the_kernels_on_the_file(single):
    emap, blob = single
    reader = Reader("direct", 4)
    try:
        runtime = _runtime(emap, budget_requirements(emap, K)[0], reader)
        gen = torch.Generator().manual_seed(6)
        for i in range(9):
            hidden, index, weights = _inputs(gen, (1, 3, 200)[i % 3])
            got = runtime.forward(i % LAYERS, hidden, index, weights)
            assert torch.equal(got, direct(emap, blob, i % LAYERS, hidden, index, weights)), i
            if i % 3 < 2:  # decode and small batches: ggml on the blocks, within 3e-2 of fp64 (see above)
                ref = fp64_reference(emap, blob, i % LAYERS, hidden, index, weights)
                assert (got.double() - ref).norm() / ref.norm() < 3e-2, i
        assert runtime.cache.stats.misses > 0
    finally:
        reader.close()


def test_quantized_experts_against_an_fp64_dequantized_reference(experts):
    emap, blob = experts
    reader = Reader("direct", 2)
    try:
        runtime = _runtime(emap, budget_requirements(emap, K)[0], reader)
        gen = torch.Generator().manual_seed(4)
        for i in range(6):
            hidden, index, weights = _inputs(gen, 1 + i)
            got = runtime.forward(i % LAYERS, hidden, index, weights).double()
            ref = fp64_reference(emap, blob, i % LAYERS, hidden, index, weights)
            assert (got - ref).norm() / ref.norm() < 3e-2, i
    finally:
        reader.close()


def test_thousand_forwards_under_random_completion_order(experts):
    emap, blob = experts
    reader = JitteryReader("direct", 8, seed=1)
    try:
        runtime = _runtime(emap, budget_requirements(emap, K)[0] + 4096 * 200, reader)
        gen = torch.Generator().manual_seed(5)
        for i in range(1000):
            hidden, index, weights = _inputs(gen, 1 + i % 4)
            got = runtime.forward(i % LAYERS, hidden, index, weights)
            assert torch.equal(got, direct(emap, blob, i % LAYERS, hidden, index, weights)), i
        assert runtime.cache.stats.misses > 1000
    finally:
        reader.close()

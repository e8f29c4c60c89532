"""ggml kernels on GGUF blocks against the gguf package's dequantizers and an fp64 product.

Tolerances: ggml converts the f32 activations to the weight type's vec_dot_type before the dot
products (llama.cpp's own behaviour), so `linear` differs from the exact product over the same
dequantized weights by that rounding alone: relative Frobenius error ~1.6e-7 (F32), 2e-4 (F16 acts),
1.6e-3 (BF16 acts), 5.4e-3 (Q8_0/Q8_1: int8 per 32, scale fp16) and 7.0e-3 (Q8_K: int8 per 256)
measured at K=2048, x ~ N(0, 1). The bounds below are ~2x those, far below any layout or scale bug
(a wrong block order or scale gives errors of order 1).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from moestream import ggml

TOL = {"F32": 1e-6, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 1.2e-2, "Q8_1": 1.2e-2, "Q8_K": 1.5e-2}
# Every type ggml multiplies that gguf can dequantize (Q1_0: gguf has no dequantizer yet).
TYPES = [
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ1_S",
    "IQ1_M",
    "IQ4_NL",
    "IQ4_XS",
    "TQ1_0",
    "TQ2_0",
    "MXFP4",
    "NVFP4",
]
GGUF_QUANTIZES = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"]
# dequantize(quantize(w)) error on N(0,1) weights, ~1.2x what ggml's quantizers give (no imatrix).
ROUNDTRIP = {
    "Q2_K": 0.36,
    "Q3_K": 0.18,
    "Q4_K": 0.085,
    "Q5_K": 0.043,
    "Q6_K": 0.022,
    "IQ4_NL": 0.09,
    "IQ4_XS": 0.092,
    "NVFP4": 0.115,
}
# ggml's IQ1/IQ2 quantizers build neighbour tables on first use (seconds); these types get random blocks
# (every grid index and sign pattern is valid) with a fixed fp16 scale `d` in each block's first 2 bytes;
# IQ1_M keeps its fp16 scale in the top nibbles of its four uint16 sub-block scales (bytes 48..55).
RANDOM_BLOCKS = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S"}
D_BITS = int(torch.tensor([0.0123], dtype=torch.float16).view(torch.int16))
N, K = 64, 512
_WEIGHTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def weights(name: str, rows: int = N, k: int = K, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(f32 source [rows, k], ggml-quantized bytes) for a type, made once per test session."""
    key = f"{name}-{rows}-{k}-{seed}"
    if key not in _WEIGHTS:
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(rows, k, generator=gen)
        t = ggml.ggml_type(name)
        if name in RANDOM_BLOCKS:
            blocks = torch.randint(
                0, 256, (t.nbytes(rows, k) // t.block_bytes, t.block_bytes), generator=gen, dtype=torch.uint8
            )
            if name == "IQ1_M":
                for i in range(4):
                    blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((D_BITS >> 4 * i) & 0xF) << 4)
            else:
                blocks[:, 0], blocks[:, 1] = D_BITS & 0xFF, D_BITS >> 8
            _WEIGHTS[key] = (w, blocks.reshape(-1))
        else:
            _WEIGHTS[key] = (w, ggml.quantize(w, name))
    return _WEIGHTS[key]


def reference(name: str, data: torch.Tensor, rows: int, k: int) -> np.ndarray:
    """The weights as the gguf package reads them: [rows, k] float64."""
    raw = data.numpy()
    if name == "F32":
        return raw.view(np.float32).reshape(rows, k).astype(np.float64)
    return gguf_dequantize(raw, GT[name]).reshape(rows, k).astype(np.float64)


def relerr(y: torch.Tensor, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y.double().numpy() - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("name", TYPES)
def test_linear_matches_fp64_product_of_gguf_dequantized_weights(name):
    _, data = weights(name)
    ref_w = reference(name, data, N, K)
    tol = TOL[ggml.ggml_type(name).vec_dot_type]
    for m in (1, 5):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        y = ggml.linear(x, data, name, N)
        assert y.shape == (m, N) and y.dtype == torch.float32
        assert relerr(y, x.double().numpy() @ ref_w.T) < tol


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_identical_to_gguf(name):
    _, data = weights(name)
    got = ggml.dequantize(data, name, N, K)
    assert got.shape == (N, K)
    np.testing.assert_array_equal(got.numpy(), reference(name, data, N, K).astype(np.float32))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "MXFP4", "BF16"])
def test_get_rows_picks_the_rows_gguf_reads(name):
    _, data = weights(name)
    ids = torch.tensor([5, 0, 63, 5, 17], dtype=torch.int32)
    got = ggml.get_rows(data, name, N, K, ids)
    np.testing.assert_array_equal(got.numpy(), reference(name, data, N, K)[ids.numpy()].astype(np.float32))
    for bad in ([64], [-1]):
        with pytest.raises(ValueError, match="lie in"):
            ggml.get_rows(data, name, N, K, torch.tensor(bad, dtype=torch.int32))


@pytest.mark.parametrize("name", GGUF_QUANTIZES)
def test_quantize_writes_the_bytes_gguf_writes(name):
    w, data = weights(name)
    np.testing.assert_array_equal(data.numpy(), gguf_quantize(w.numpy(), GT[name]).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("name", sorted(ROUNDTRIP))
def test_quantize_roundtrip_error_is_that_of_the_format(name):
    # gguf cannot quantize these; its dequantizer reads what ggml wrote back to within the format's error.
    w, data = weights(name)
    assert data.numel() == ggml.ggml_type(name).nbytes(N, K)
    back = reference(name, data, N, K)
    assert relerr(w, back) < ROUNDTRIP[name]


def test_quantize_threads_do_not_change_the_bytes():
    w, data = weights("Q4_K")
    assert torch.equal(ggml.quantize(w, "Q4_K", threads=3), data)
    assert torch.equal(ggml.quantize(w, "Q4_K", threads=1), data)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("MXFP4",) * 3, ("Q8_0", "Q4_0", "IQ4_XS")])
def test_swiglu_expert_graph_equals_three_calls_bit_for_bit(types):
    h, inter = 512, 256
    g, u, d = (
        weights(t, rows, k, seed)[1]
        for t, rows, k, seed in zip(types, (inter, inter, h), (h, h, inter), (1, 2, 3))
    )
    for m in (1, 5):
        x = torch.randn(m, h, generator=torch.Generator().manual_seed(10 + m))
        y = ggml.swiglu_expert(x, g, u, d, types, inter)
        gate, up = ggml.linear(x, g, types[0], inter), ggml.linear(x, u, types[1], inter)
        composed = ggml.linear(ggml.swiglu(gate, up), d, types[2], h)
        assert torch.equal(y, composed)
        # and the math is SwiGLU: against fp64 over gguf's dequantized weights
        rg, ru, rd = (
            torch.from_numpy(reference(t, b, r, k))
            for t, b, r, k in zip(types, (g, u, d), (inter, inter, h), (h, h, inter))
        )
        xd = x.double()
        expect = (F.silu(xd @ rg.T) * (xd @ ru.T)) @ rd.T
        assert relerr(y, expect.numpy()) < 2.5e-2


def test_several_experts_in_one_graph_equal_one_graph_per_expert_bit_for_bit():
    """linear_experts (decode: one matrix kind of every cached expert of a token in one compute) against
    linear per expert, on shared rows and on each expert's own rows, for the types of a Q4_K_M."""
    h, inter, n = 512, 256, 9
    for t in ("Q4_K", "Q6_K", "Q8_0"):
        ws = [weights(t, inter, h, 7 * i)[1] for i in range(n)]
        x = torch.randn(1, h, generator=torch.Generator().manual_seed(3))
        y = ggml.linear_experts(x, ws, t, inter)
        assert y.shape == (n, 1, inter)
        for w, yi in zip(ws, y):
            assert torch.equal(yi, ggml.linear(x, w, t, inter))
        assert not torch.equal(y[0], y[3])  # distinct weights give distinct outputs (the pointers are used)
        own = torch.randn(n, 2, h, generator=torch.Generator().manual_seed(4))  # expert i's rows own[i]
        y = ggml.linear_experts(own, ws, t, inter)
        for w, xi, yi in zip(ws, own, y):
            assert torch.equal(yi, ggml.linear(xi, w, t, inter))
    with pytest.raises(ValueError, match="rows for 2 experts"):
        ggml.linear_experts(torch.zeros(2, 1, h), ws, "Q8_0", inter)


def test_swiglu_op_is_silu_times_up():
    g, u = torch.randn(3, 700), torch.randn(3, 700)
    torch.testing.assert_close(ggml.swiglu(g, u), F.silu(g) * u, rtol=1e-5, atol=1e-6)


def test_graph_reuse_by_pointer_swap_gives_identical_results():
    _, a = weights("Q4_K", seed=0)
    _, b = weights("Q4_K", seed=1)
    x1, x2 = torch.randn(4, K), torch.randn(4, K)
    ya = ggml.linear(x1, a, "Q4_K", N)
    graphs = ggml.kernels().graphs
    yb = ggml.linear(x1, b, "Q4_K", N)
    y2 = ggml.linear(x2, a, "Q4_K", N)
    out = torch.full((4, N), float("nan"))
    ya_again = ggml.linear(x1, a.clone(), "Q4_K", N, out=out)  # another copy at another address
    assert ggml.kernels().graphs == graphs  # one graph served every call
    assert ya_again is out and torch.equal(ya_again, ya)
    assert not torch.equal(yb, ya) and not torch.equal(y2, ya)
    assert torch.equal(y2, ggml.linear(x2, a, "Q4_K", N))


def test_graph_cache_is_bounded_and_rebuilds_what_it_dropped(monkeypatch):
    from moestream.ggml import graphs

    monkeypatch.setattr(graphs, "MAX_GRAPHS", 3)
    _, data = weights("Q4_K")
    xs = [torch.randn(m, K) for m in range(1, 6)]  # five shapes: five graphs through a cache of three
    first = [ggml.linear(x, data, "Q4_K", N) for x in xs]
    assert ggml.kernels().graphs == 3
    assert all(torch.equal(a, ggml.linear(x, data, "Q4_K", N)) for a, x in zip(first, xs))


def test_one_and_two_threads_agree_bit_for_bit():
    _, data = weights("Q6_K")
    x = torch.randn(7, K)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = ggml.linear(x, data, "Q6_K", N)
        torch.set_num_threads(2)
        y2 = ggml.linear(x, data, "Q6_K", N)
        assert ggml.kernels().n_threads == 2
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)


def _cpu_seconds_while_sleeping(seconds: float = 0.3) -> float:
    import time

    t0 = os.times()
    time.sleep(seconds)
    t1 = os.times()
    return (t1.user + t1.system) - (t0.user + t0.system)


def test_threadpool_sleeps_between_computes_unless_held():
    _, data = weights("Q4_K")
    x = torch.randn(1, K)
    k = ggml.kernels(2)
    out = torch.empty(1, N)
    addresses = dict(w=data.data_ptr(), x=x.data_ptr(), out=out.data_ptr())

    def build(b):
        return b.op("mul_mat", b.input("w", ggml.ggml_type("Q4_K").id, K, N), b.input("x", 0, K, 1))

    k.compute(("probe-linear",), build, **addresses)
    assert _cpu_seconds_while_sleeping() < 0.03  # paused: the worker waits on a condition variable
    with k.hold():
        k.compute(("probe-linear",), build, **addresses)
        spinning = _cpu_seconds_while_sleeping(1.0)  # 1 s: a loaded machine gives the poller less
    assert _cpu_seconds_while_sleeping() < 0.03  # paused again on leaving hold()
    assert spinning > 0.06  # control: a held pool polls for work, which is what pausing avoids
    torch.testing.assert_close(out, ggml.linear(x, data, "Q4_K", N), rtol=0, atol=0)


def test_single_task_graphs_run_on_the_calling_thread_alone():
    # ggml runs get_rows on one thread: its graph is planned on a pool of the caller alone, so the
    # main pool's worker is not woken to poll beside it.
    _, data = weights("Q6_K")
    k = ggml.kernels(2)
    y, ids = torch.empty(N, K), torch.arange(N, dtype=torch.int32)

    def build(b):
        return b.op("get_rows", b.input("w", ggml.ggml_type("Q6_K").id, K, N), b.input("ids", 26, N, 1))

    k.compute(("probe-rows",), build, w=data.data_ptr(), ids=ids.data_ptr(), out=y.data_ptr())
    g = k._graphs[("probe-rows",)]
    assert g.pool == k.solo != k.pool and g.plan.n_threads == 1
    assert torch.equal(y, ggml.dequantize(data, "Q6_K", N, K))

"""The kernels moestream computes GGUF blocks with: linear (one expert or several), a whole SwiGLU
expert, dequantize, quantize.

Weights are the bytes of a [rows, K] matrix as stored in a GGUF file (rows back to back, unpadded),
given as a torch tensor over those bytes (any dtype, contiguous, CPU) or as a raw address. A weight
address must be 32-byte aligned (GGUF aligns tensor data to 32 bytes and moestream's slots keep the
file offset modulo 4096); an unaligned one is refused with ValueError, never copied. Activations are
float32 [M, K] (ggml quantizes them to the weight type's `vec_dot_type` inside the product).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from moestream.ggml.graphs import F32, I32, Builder, kernels
from moestream.ggml.lib import library
from moestream.ggml.types import GgmlType, TypeLike, ggml_type

WEIGHT_ALIGNMENT = 32
Weight = torch.Tensor | int


def _weight_address(w: Weight, t: GgmlType, rows: int, k: int, what: str) -> int:
    """The checked address of a [rows, k] matrix of type t."""
    if rows <= 0:
        raise ValueError(f"{what} needs a positive number of rows, not {rows}")
    if isinstance(w, torch.Tensor):
        if w.device.type != "cpu" or not w.is_contiguous():
            raise ValueError(f"{what} must be a contiguous CPU tensor")
        need = t.nbytes(rows, k)
        if w.numel() * w.element_size() < need:
            raise ValueError(
                f"{what} holds {w.numel() * w.element_size()} bytes; a {t.name} [{rows}, {k}] "
                f"matrix needs {need}"
            )
        address = w.data_ptr()
    else:
        t.row_bytes(k)
        address = int(w)
        if address == 0:
            raise ValueError(f"{what} is a null address")
    if address % WEIGHT_ALIGNMENT:
        raise ValueError(f"{what} at 0x{address:x} is not {WEIGHT_ALIGNMENT}-byte aligned")
    return address


def _activations(x: torch.Tensor, k: int, what: str = "x") -> int:
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous float32 CPU tensor [M, K]; got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}"
        )
    if x.shape[1] != k:
        raise ValueError(f"{what} has {x.shape[1]} columns; the weight has K = {k}")
    return x.data_ptr()


def _out(out: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    if (
        out.dtype != torch.float32
        or tuple(out.shape) != shape
        or not out.is_contiguous()
        or out.device.type != "cpu"
    ):
        raise ValueError(
            f"out must be a contiguous float32 tensor {list(shape)}; got {out.dtype} {tuple(out.shape)}"
        )
    return out


def linear(
    x: torch.Tensor, weight: Weight, type: TypeLike, rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] f32 @ W.T for W the [rows, K] matrix of GGML `type` at `weight`: returns [M, rows] f32.

    One ggml mul_mat, graph cached per (type, rows, K, M); runs on the shared threadpool (torch's thread
    count) and pauses it afterwards. `out`, when given, receives the result (no allocation at all).
    """
    t = ggml_type(type)
    m, k = x.shape if x.dim() == 2 else (0, 0)
    xa = _activations(x, k)
    wa = _weight_address(weight, t, rows, k, "weight")
    y = _out(out, (m, rows))
    if m == 0:  # no rows routed to this expert: nothing to compute (ggml asserts on empty tensors)
        return y
    kern = kernels()

    def build(b: Builder) -> int:
        return b.op("mul_mat", b.input("w", t.id, k, rows), b.input("x", F32, k, m))

    kern.compute(("linear", t.id, rows, k, m), build, w=wa, x=xa, out=y.data_ptr())
    return y


_ZEROS: dict[int, torch.Tensor] = {}


def linear_id(
    x: torch.Tensor, weight: Weight, type: TypeLike, rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear` by ggml_mul_mat_id over one expert: x [M, K] f32 -> [M, rows] f32.

    The kernel the ggml graphs compute a layer's cached experts with (one mul_mat_id over the cache's
    slots), so an expert computed alone as its bytes land gives the very same bits; ggml_mul_mat may
    take other kernels (llamafile's sgemm) for the same product.
    """
    t = ggml_type(type)
    m, k = x.shape if x.dim() == 2 else (0, 0)
    xa = _activations(x, k)
    wa = _weight_address(weight, t, rows, k, "weight")
    y = _out(out, (m, rows))
    if m == 0:
        return y
    ids = _ZEROS.get(m)
    if ids is None:
        ids = _ZEROS.setdefault(m, torch.zeros(m, dtype=torch.int32))  # every row uses expert 0
    kern = kernels()

    def build(b: Builder) -> int:
        w = b.input("w", t.id, k, rows, 1)  # [K, rows, 1 expert]
        return b.op("mul_mat_id", w, b.input("x", F32, k, 1, m), b.input("ids", I32, 1, m))

    kern.compute(("linear_id", t.id, rows, k, m), build, w=wa, x=xa, ids=ids.data_ptr(), out=y.data_ptr())
    return y


def _three(types: TypeLike | Sequence[TypeLike]) -> tuple[GgmlType, GgmlType, GgmlType]:
    if isinstance(types, (list, tuple)):
        if len(types) != 3:
            raise ValueError("types is one type or a (gate, up, down) triple")
        return ggml_type(types[0]), ggml_type(types[1]), ggml_type(types[2])
    t = ggml_type(types)
    return t, t, t


def swiglu_expert(
    x: torch.Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
    types: TypeLike | Sequence[TypeLike],
    intermediate: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) in one ggml compute: x [M, H] f32 -> [M, H] f32.

    gate and up are [intermediate, H] matrices, down is [H, intermediate]; `types` is one type or a
    (gate, up, down) triple (a Q4_K_M file has Q4_K gate/up and Q6_K down in some layers). The graph
    (3 mul_mat + swiglu_split) is cached per (types, intermediate, H, M).
    """
    tg, tu, td = _three(types)
    m, h = x.shape if x.dim() == 2 else (0, 0)
    xa = _activations(x, h)
    addresses = dict(
        gate=_weight_address(gate, tg, intermediate, h, "gate"),
        up=_weight_address(up, tu, intermediate, h, "up"),
        down=_weight_address(down, td, h, intermediate, "down"),
    )
    y = _out(out, (m, h))
    if m == 0:
        return y
    kern = kernels()

    def build(b: Builder) -> int:
        xt = b.input("x", F32, h, m)
        g = b.op("mul_mat", b.input("gate", tg.id, h, intermediate), xt)
        u = b.op("mul_mat", b.input("up", tu.id, h, intermediate), xt)
        return b.op("mul_mat", b.input("down", td.id, intermediate, h), b.op("swiglu_split", g, u))

    key = ("swiglu", tg.id, tu.id, td.id, intermediate, h, m)
    kern.compute(key, build, x=xa, out=y.data_ptr(), **addresses)
    return y


def linear_experts(
    x: torch.Tensor, weights: Sequence[Weight], type: TypeLike, rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Several experts' `linear` in one ggml compute: x [M, K] f32 (every expert's rows) or [E, M, K]
    (expert i's own rows x[i]) by each [rows, K] matrix of GGML `type` -> [E, M, rows] f32.

    Node for node `linear`'s mul_mat per expert (the same kernel on the same inputs), so out[i] equals
    `linear(x or x[i], weights[i])` bit for bit; one compute instead of one per expert (decode: every
    routed expert of a token that the cache holds). The graph is cached per (type, rows, K, M, E).
    """
    t, n = ggml_type(type), len(weights)
    shared = x.dim() == 2
    m, k = (x.shape if shared else x.shape[1:]) if x.dim() in (2, 3) else (0, 0)
    if not shared and x.shape[0] != n:
        raise ValueError(f"{n} weights but x holds rows for {x.shape[0]} experts")
    xs = [x] if shared else list(x)
    addresses = {"x" if shared else f"x{i}": _activations(xi, k) for i, xi in enumerate(xs)}
    y = torch.empty((n, m, rows), dtype=torch.float32) if out is None else out
    if y.dtype != torch.float32 or tuple(y.shape) != (n, m, rows) or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor {[n, m, rows]}")
    if m == 0 or n == 0:
        return y
    for i, w in enumerate(weights):
        addresses[f"w{i}"] = _weight_address(w, t, rows, k, "weight")
        addresses[f"out{i}"] = y[i].data_ptr()

    def build(b: Builder) -> list[int]:
        xt = b.input("x", F32, k, m) if shared else None
        return [
            b.op("mul_mat", b.input(f"w{i}", t.id, k, rows), xt if shared else b.input(f"x{i}", F32, k, m))
            for i in range(n)
        ]

    key = ("linear_n", t.id, rows, k, m, n, shared)
    kernels().compute(key, build, nodes=2 * n + 2, **addresses)
    return y


def swiglu(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up computed by ggml (the op inside swiglu_expert): [M, N] f32 each."""
    return _glu("swiglu_split", gate, up, out)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU computed by ggml (ggml_swiglu_oai, the op its graphs use): gate and up
    [M, N] f32 -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    return _glu("swiglu_oai", gate, up, None, alpha, limit)


def _glu(
    op: str, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None, *params: float
) -> torch.Tensor:
    """ggml_<op>(gate, up, *params) on [M, N] f32 each -> [M, N] f32 (into `out` when given)."""
    m, n = gate.shape if gate.dim() == 2 else (0, 0)
    ga, ua = _activations(gate, n, "gate"), _activations(up, n, "up")
    if up.shape[0] != m:
        raise ValueError(f"gate has {m} rows and up {up.shape[0]}")
    y = _out(out, (m, n))
    if m == 0:
        return y

    def build(b: Builder) -> int:
        return b.op(op, b.input("g", F32, n, m), b.input("u", F32, n, m), *params)

    kernels().compute((op, n, m, *params), build, g=ga, u=ua, out=y.data_ptr())
    return y


def get_rows(
    weight: Weight, type: TypeLike, rows: int, k: int, ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows `ids` (int32 [n], each in [0, rows)) of a [rows, k] matrix of GGML `type`, as f32 [n, k].

    ggml's get_rows: each row is decoded by the type's to_float, rows split over the pool's threads;
    an embedding lookup on a quantized token table.
    """
    t = ggml_type(type)
    if ids.dtype != torch.int32 or ids.dim() != 1 or not ids.is_contiguous() or ids.device.type != "cpu":
        raise ValueError(f"ids must be a contiguous int32 CPU tensor [n]; got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):  # ggml aborts on a bad index
        raise ValueError(f"row ids must lie in [0, {rows})")
    return _get_rows(t, weight, rows, k, ids, out)


def _get_rows(
    t: GgmlType, weight: Weight, rows: int, k: int, ids: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    wa = _weight_address(weight, t, rows, k, "weight")
    n = ids.numel()
    y = _out(out, (n, k))
    if n == 0:
        return y
    kern = kernels()

    def build(b: Builder) -> int:
        return b.op("get_rows", b.input("w", t.id, k, rows), b.input("ids", I32, n, 1))

    kern.compute(("get_rows", t.id, rows, k, n), build, w=wa, ids=ids.data_ptr(), out=y.data_ptr())
    return y


_ARANGE: dict[int, torch.Tensor] = {}


def dequantize(
    weight: Weight, type: TypeLike, rows: int, k: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The [rows, k] f32 values of a matrix of GGML `type` (get_rows of every row: ggml's to_float)."""
    ids = _ARANGE.get(rows)
    if ids is None:
        ids = _ARANGE.setdefault(rows, torch.arange(rows, dtype=torch.int32))
    return _get_rows(ggml_type(type), weight, rows, k, ids, out)


def quantize(
    w: torch.Tensor, type: TypeLike, imatrix: torch.Tensor | None = None, threads: int | None = None
) -> torch.Tensor:
    """Quantize f32 w [N, K] to GGML `type` with ggml_quantize_chunk: uint8 [N * row_bytes(K)], GGUF layout.

    Runs ggml's reference quantizers (the ones llama-quantize uses), rows split over `threads` Python
    threads (default torch's count; ctypes releases the GIL). `imatrix` [K] f32 weights the error per
    column; the IQ1/IQ2 types need one.
    """
    t = ggml_type(type)
    lib = library()
    if w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous() or w.device.type != "cpu":
        raise ValueError(f"w must be a contiguous float32 CPU tensor [N, K]; got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    rb = t.row_bytes(k)
    im = 0
    if imatrix is not None:
        if imatrix.dtype != torch.float32 or tuple(imatrix.shape) != (k,) or not imatrix.is_contiguous():
            raise ValueError(f"imatrix must be a contiguous float32 tensor [{k}]")
        im = imatrix.data_ptr()
    elif t.needs_imatrix:
        raise ValueError(f"ggml quantizes {t.name} only with an importance matrix (imatrix)")
    dst = torch.empty(n * rb, dtype=torch.uint8)
    n_threads = max(1, min(threads or torch.get_num_threads(), n))
    bounds = [n * i // n_threads for i in range(n_threads + 1)]

    def chunk(i: int) -> int:
        r0, r1 = bounds[i], bounds[i + 1]
        return lib.base.ggml_quantize_chunk(t.id, w.data_ptr(), dst.data_ptr(), r0 * k, r1 - r0, k, im)

    with ThreadPoolExecutor(n_threads) as ex:
        written = sum(ex.map(chunk, range(n_threads)))
    if written != n * rb:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes of {n * rb}")
    return dst

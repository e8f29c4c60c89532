"""Torch entry points of the GGUF block kernels: checks, tile configs, launches (imports triton).

Weights are uint8 tensors over GGUF bytes exactly as stored: a matrix [N, K] is N rows of
K / block * block_bytes bytes, back to back. Any contiguous uint8 tensor works, including a view
that starts at any byte of a larger buffer (GPU slots hold several kinds back to back): the kernels
read bytes, so they need no alignment. With CUDA activations the weights may also be pinned host
memory (page-locked, hence mapped for the GPU: unified memory), read in place.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from moestream.kernels.choice import Route, choose
from moestream.kernels.triton_kernels import dequantize_kernel, matmul_kernel
from moestream.kernels.types import BlockType, TypeLike, block_type

# IQ4_NL's 16 non-uniform values (ggml's kvalues_iq4nl); IQ4_XS uses the same table
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_luts: dict[torch.device, torch.Tensor] = {}


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# triton.jit read the same variable when triton_kernels was imported: kernels and flag agree
INTERPRETED = _interpreted()


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape of one matmul launch: BM x BN outputs, BK columns per step; `dot` uses tl.dot."""

    block_m: int
    block_n: int
    block_k: int
    dot: bool
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two, not {value}")
        if self.dot and min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError("a tl.dot tile needs block_m, block_n and block_k of at least 16")


@functools.lru_cache(maxsize=1024)
def default_config(m: int, n: int, k: int, dtype: torch.dtype) -> KernelConfig:
    """The tile for m rows of x (per matrix), n outputs and k inputs. PLACEHOLDER sizes, chosen without
    a GPU: fp32 FMA tiles up to 8 rows (and for fp32 x), ~4096 products per step, narrow in n so that
    the decode shapes (n = 768..2880) give a few hundred programs; tensor-core tiles above 8 rows.
    `benchmarks/cuda_kernels.py --tune` compares alternatives on a GPU."""
    if m <= 8 or dtype == torch.float32:
        bm = 1 if m <= 1 else min(8, triton.next_power_of_2(m))
        bn = 4 if n < 1536 else 8 if n < 4096 else 16
        if os.environ.get("TRITON_INTERPRET") == "1":
            # Triton's interpreter (the CPU tests) runs each program in Python, one after another: a
            # few wide programs cost a fifth of many narrow ones (the suite's grouped-layer tests 71 ->
            # 13 s); bits can differ from the GPU's tile (block_k follows), as they do between GPUs
            bn = 64
        bk = max(32, min(4096 // (bn * bm), 512, triton.next_power_of_2(k)))
        return KernelConfig(bm, bn, bk, dot=False)
    bm = min(64, max(16, triton.next_power_of_2(m)))
    # 8 warps for the 64-row tile: with 4, ptxas needs ~254 registers a thread (sm_90)
    return KernelConfig(bm, 32 if n < 4096 else 64, 64, dot=True, num_warps=8 if bm >= 64 else 4)


def _lut(device: torch.device) -> torch.Tensor:
    lut = _luts.get(device)
    if lut is None:
        lut = _luts[device] = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)
    return lut


def _check_weight(w: torch.Tensor, device: torch.device, need: int, what: str) -> None:
    if w.dtype != torch.uint8 or not w.is_contiguous():
        raise ValueError(f"{what} must be a contiguous uint8 tensor of GGUF blocks, not {w.dtype}")
    # pinned host memory is mapped into the GPU's address space: kernels read it in place (unified)
    in_place = device.type == "cuda" and w.device.type == "cpu" and w.is_pinned()
    if w.device != device and not in_place:
        raise ValueError(f"{what} is on {w.device} (not pinned) but the activations are on {device}")
    if w.numel() < need:
        raise ValueError(f"{what} holds {w.numel()} bytes, fewer than the {need} the matrix needs")


def _check_x(x: torch.Tensor, bt: BlockType) -> int:
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(
            f"x must be a 2-D bf16/fp16/fp32 tensor with contiguous rows, not {tuple(x.shape)} {x.dtype}"
        )
    return bt.row_bytes(x.shape[1])


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    qtype: TypeLike | BlockType,
    n: int,
    *,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T for W [n, K] stored as GGUF `qtype` blocks in `w` -> [M, n] in x's dtype, with
    fp32 accumulation (see triton_kernels for the two tile kinds). `out` may be given ([M, n],
    contiguous, x's dtype); `config` overrides the tile (benchmarks)."""
    bt = block_type(qtype)
    row_bytes = _check_x(x, bt)
    _check_weight(w, x.device, n * row_bytes, f"the {bt.name} weight")
    m, k = x.shape
    out = _output(out, (m, n), x)
    if m == 0:
        return out
    cfg = config or default_config(m, n, k, x.dtype)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), 1)
    _launch(grid, x, w, out, bt, n, k, row_bytes, cfg, m=m)
    return out


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    qtype: TypeLike | BlockType,
    n: int,
    offsets: torch.Tensor,
    starts: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    max_rows: int | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Several [n, K] matrices of one type in one launch (a layer's experts in a GPU slot buffer).

    Matrix e starts `offsets[e]` bytes (int64 [E], on x's device) into the uint8 buffer `w` and
    computes output rows starts[e] .. starts[e+1] (int32/int64 [E + 1], non-decreasing, on x's device)
    from x rows rows[r] (int32/int64 [R]; default r itself). Returns out [R, n], R = len(rows) (or
    x's row count), and starts[-1] must be R. `max_rows` bounds starts[e+1] - starts[e] (default R);
    the caller knows it from the routing it read back, and the tile kind is chosen from it. Offsets
    and starts are not checked against the buffer (that would need a device synchronisation)."""
    bt = block_type(qtype)
    row_bytes = _check_x(x, bt)
    _check_weight(w, x.device, 1, "the weight buffer")
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.device != x.device:
        raise ValueError(f"offsets must be a 1-D int64 tensor on {x.device}")
    if starts.dim() != 1 or starts.numel() != offsets.numel() + 1 or starts.dtype not in _INDEX:
        raise ValueError("starts must be a 1-D int32/int64 tensor of one more element than offsets")
    if starts.device != x.device:
        raise ValueError(f"starts must be on {x.device}")
    if rows is not None and (rows.dim() != 1 or rows.dtype not in _INDEX or rows.device != x.device):
        raise ValueError(f"rows must be a 1-D int32/int64 tensor on {x.device}")
    total = rows.numel() if rows is not None else x.shape[0]
    out = _output(out, (total, n), x)
    limit = total if max_rows is None else min(max_rows, total)
    if total == 0 or offsets.numel() == 0 or limit <= 0:
        return out
    cfg = config or default_config(limit, n, x.shape[1], x.dtype)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(limit, cfg.block_m), offsets.numel())
    _launch(grid, x, w, out, bt, n, x.shape[1], row_bytes, cfg, offsets=offsets, starts=starts, rows=rows)
    return out


_INDEX = (torch.int32, torch.int64)


def _output(out: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != shape or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {list(shape)} on {x.device}")
    return out


def _launch(grid, x, w, out, bt, n, k, row_bytes, cfg, m=0, offsets=None, starts=None, rows=None) -> None:
    grouped = offsets is not None
    matmul_kernel[grid](
        x,
        w,
        out,
        _lut(x.device),
        offsets if grouped else w,
        starts if grouped else w,
        rows if rows is not None else w,
        m,
        n,
        k,
        row_bytes,
        x.stride(0),
        QTYPE=bt.id,
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
        DOT=cfg.dot,
        GROUPED=grouped,
        HAS_ROWS=rows is not None,
        INTERPRET=INTERPRETED,
        num_warps=cfg.num_warps,
    )


def dequantize(
    w: torch.Tensor,
    qtype: TypeLike | BlockType,
    n: int,
    k: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    out: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """GGUF `qtype` blocks of an [n, k] matrix -> dense [n, k] in `dtype` (bf16/fp16/fp32) on `device`
    (default w's; a GPU for pinned host w); into `out` when given (a reused scratch tensor of that
    shape and dtype, whose device then counts). With `ids` (int32/int64 [R] on that device, each in
    0..n-1, not checked), only those rows: [R, k] (an embedding lookup)."""
    bt = block_type(qtype)
    where = out.device if out is not None else torch.device(device) if device is not None else w.device
    _check_weight(w, where, bt.nbytes(n, k), f"the {bt.name} weight")
    if ids is not None and (ids.dim() != 1 or ids.dtype not in _INDEX or ids.device != where):
        raise ValueError(f"ids must be a 1-D int32/int64 tensor on {where}")
    rows = n if ids is None else ids.numel()
    if out is None:
        out = torch.empty((rows, k), dtype=dtype, device=where)
    elif tuple(out.shape) != (rows, k) or out.dtype not in ACTIVATION_DTYPES or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16/fp16/fp32 tensor of shape [{rows}, {k}]")
    if rows:
        bn, bk = 8, 256  # 16 x 256 needs up to 255 registers a thread for Q3_K (sm_90)
        grid = (triton.cdiv(rows, bn), triton.cdiv(k, bk))
        dequantize_kernel[grid](
            w,
            out,
            _lut(where),
            ids if ids is not None else w,
            rows,
            k,
            bt.row_bytes(k),
            QTYPE=bt.id,
            BN=bn,
            BK=bk,
            HAS_IDS=ids is not None,
            INTERPRET=INTERPRETED,
        )
    return out


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    qtype: TypeLike | BlockType,
    n: int,
    *,
    scratch: torch.Tensor | None = None,
    route: Route | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, n] by the route `choose(qtype, M)` picks (or `route`): the direct
    kernel, or dequantize into `scratch` ([n, K] in x's dtype, allocated when None) + torch matmul."""
    route = route or choose(block_type(qtype).name, x.shape[0])
    if route == "direct":
        return matmul(x, w, qtype, n)
    dense = dequantize(w, qtype, n, x.shape[1], x.dtype, out=scratch)
    return x @ dense.T

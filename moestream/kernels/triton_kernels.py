"""Triton kernels over GGUF blocks: x @ W^T with W decoded in registers, and W -> dense (imports triton).

`matmul_kernel` computes one [BM, BN] tile of out = x @ W^T for W [N, K] stored as GGUF blocks, with
fp32 accumulation, in one of two ways chosen by the `DOT` constexpr:
  * DOT = False (decode sizes, M <= 8): products and sums in fp32 on the CUDA cores, the weights kept
    in fp32 as decoded: out = round(sum_k x[m, k] * W[n, k]) with one rounding, to the output dtype;
  * DOT = True (prefill sizes): the decoded tile is rounded to x's dtype (bf16/fp16) and multiplied on
    the tensor cores (tl.dot, fp32 accumulator), as a dequantize-then-matmul in that dtype would.
With GROUPED, one launch computes several matrices of the same type and shape that live in one buffer
(a layer's experts in GPU slots): program_id(2) is the matrix e, at byte `offsets[e]` of `w_ptr`; it
computes output rows starts[e] .. starts[e+1] from x rows `rows[r]` (or r when there is no `rows`).

Sizes are runtime values. M, N and row_bytes are not specialised on; K and x's row stride are (Triton
compiles one variant for multiples of 16, which lets it vectorise the loads of x), so one or two
compiled kernels per (type, tile, flags) serve every shape of a model.

INTERPRET adapts the code to Triton's CPU interpreter (TRITON_INTERPRET=1, used by the CPU tests),
which in Triton 3.6 truncates fp32 -> bf16, multiplies bf16 tiles as integers in tl.dot, and cannot
take a runtime bound in range() under numpy >= 2.4; the products and roundings stay the GPU's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moestream.kernels.decode import decode


@triton.jit
def _round(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """v (fp32) rounded to nearest even in `dtype` (in the interpreter, on the bits, for finite v)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def _step(
    acc,
    x_ptr,
    src,
    r_ok,
    stride_xm,
    w,
    n,
    k0,
    N,
    K,
    row_bytes,
    lut,
    QTYPE: tl.constexpr,
    BK: tl.constexpr,
    DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """acc [BM, BN] += x[src, k0 : k0 + BK] @ W[n, k0 : k0 + BK]^T."""
    kk = k0 + tl.arange(0, BK)
    k_ok = kk < K
    x = tl.load(x_ptr + src[:, None] * stride_xm + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    # W^T tile [BK, BN]; rows past N and columns past K decode clamped indices (every load stays inside
    # the matrix), and the columns are zeroed
    wt = decode(w, tl.minimum(n, N - 1)[None, :], tl.minimum(kk, K - 1)[:, None], row_bytes, lut, QTYPE)
    wt = tl.where(k_ok[:, None], wt, 0.0)
    if DOT:
        wt = _round(wt, x.dtype, INTERPRET)
        if INTERPRET:  # exact products of the same bf16 values, in fp32
            acc += tl.dot(x.to(tl.float32), wt.to(tl.float32))
        else:
            acc = tl.dot(x, wt, acc)
    else:
        acc += tl.sum(x.to(tl.float32)[:, :, None] * wt[None, :, :], axis=1)
    return acc


@triton.jit(do_not_specialize=["M", "N", "row_bytes"])
def matmul_kernel(
    x_ptr,  # [*, K] bf16/fp16/fp32, last dim contiguous
    w_ptr,  # uint8: the matrix (or, GROUPED, the buffer holding every matrix)
    out_ptr,  # [R, N], contiguous, x's dtype
    lut_ptr,  # fp32 [16]: IQ4 values (any pointer for other types)
    offsets_ptr,  # GROUPED: int64 [E], byte offset of matrix e from w_ptr
    starts_ptr,  # GROUPED: int32/int64 [E + 1], output rows of matrix e
    rows_ptr,  # HAS_ROWS: int32/int64 [R], the x row of each output row
    M,  # not GROUPED: rows of x and out
    N,
    K,
    row_bytes,
    stride_xm,
    QTYPE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if GROUPED:
        e = tl.program_id(2)
        w = w_ptr + tl.load(offsets_ptr + e)
        first = tl.load(starts_ptr + e).to(tl.int32)
        end = tl.load(starts_ptr + e + 1).to(tl.int32)
    else:
        w = w_ptr
        first = 0
        end = M
    if first + pid_m * BM >= end:
        return  # an expert with fewer rows than the grid has row tiles
    r = first + pid_m * BM + tl.arange(0, BM)  # output rows [BM]
    r_ok = r < end
    if HAS_ROWS:
        src = tl.load(rows_ptr + r, mask=r_ok, other=0).to(tl.int64)
    else:
        src = r.to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if INTERPRET:
        k0 = 0
        while k0 < K:
            acc = _step(
                acc,
                x_ptr,
                src,
                r_ok,
                stride_xm,
                w,
                n,
                k0,
                N,
                K,
                row_bytes,
                lut_ptr,
                QTYPE,
                BK,
                DOT,
                INTERPRET,
            )
            k0 += BK
    else:
        for k0 in range(0, K, BK):
            acc = _step(
                acc,
                x_ptr,
                src,
                r_ok,
                stride_xm,
                w,
                n,
                k0,
                N,
                K,
                row_bytes,
                lut_ptr,
                QTYPE,
                BK,
                DOT,
                INTERPRET,
            )
    out = out_ptr + r.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, _round(acc, out_ptr.dtype.element_ty, INTERPRET), mask=r_ok[:, None] & (n < N)[None, :])


@triton.jit(do_not_specialize=["N", "K", "row_bytes"])
def dequantize_kernel(
    w_ptr,  # uint8: the matrix
    out_ptr,  # [R, K] contiguous, bf16/fp16/fp32; R = N, or the number of ids
    lut_ptr,
    ids_ptr,  # HAS_IDS: int32/int64 [R], the matrix row of each output row (an embedding lookup)
    N,  # output rows R
    K,
    row_bytes,
    QTYPE: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HAS_IDS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    r = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    r_safe = tl.minimum(r, N - 1)
    n = tl.load(ids_ptr + r_safe) if HAS_IDS else r_safe
    w = decode(w_ptr, n[:, None], tl.minimum(kk, K - 1)[None, :], row_bytes, lut_ptr, QTYPE)
    out = out_ptr + r.to(tl.int64)[:, None] * K + kk[None, :]
    tl.store(out, _round(w, out_ptr.dtype.element_ty, INTERPRET), mask=(r < N)[:, None] & (kk < K)[None, :])

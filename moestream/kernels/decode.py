"""Triton decoders: GGUF blocks as stored -> fp32 weights, one element per lane (imports triton).

Every decoder takes `rowp`, byte pointers to the first byte of each weight's row, and `k`, each
weight's column; the two broadcast against each other, so the same decoder yields a [BN, BK] or a
[BK, BN] tile. Each element finds its block (k // block), reads the bytes it needs with byte loads,
and applies the block's scales. Byte loads put no alignment requirement on the matrix: it may start
at any byte of a larger buffer (fp16 scales are assembled from two bytes). Within a block the layouts
are ggml's (ggml-common.h; dequantize_row_* in ggml-quants.c), and the arithmetic follows the order of
gguf.quants' numpy dequantizers, so the fp32 results equal theirs (up to fused multiply-adds).
"""

from __future__ import annotations

import triton
import triton.language as tl

# ggml type ids (moestream.kernels.types): the `QTYPE` constexpr of `decode`
Q4_0: tl.constexpr = tl.constexpr(2)
Q4_1: tl.constexpr = tl.constexpr(3)
Q5_0: tl.constexpr = tl.constexpr(6)
Q5_1: tl.constexpr = tl.constexpr(7)
Q8_0: tl.constexpr = tl.constexpr(8)
Q2_K: tl.constexpr = tl.constexpr(10)
Q3_K: tl.constexpr = tl.constexpr(11)
Q4_K: tl.constexpr = tl.constexpr(12)
Q5_K: tl.constexpr = tl.constexpr(13)
Q6_K: tl.constexpr = tl.constexpr(14)
IQ4_NL: tl.constexpr = tl.constexpr(20)
IQ4_XS: tl.constexpr = tl.constexpr(23)
MXFP4: tl.constexpr = tl.constexpr(39)


@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _f16(p):
    """The little-endian fp16 at byte pointers p, as fp32."""
    bits = tl.load(p).to(tl.uint16) | (tl.load(p + 1).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble32(qs, j):
    """Weight j (0..31) of a 32-weight block whose 16 bytes at qs hold j in the low nibble of byte j
    and j + 16 in the high nibble (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4)."""
    return (_u8(qs + (j % 16)) >> ((j // 16) * 4)) & 15


@triton.jit
def _q4_0(rowp, k):
    blk = rowp + (k // 32) * 18  # d: fp16, qs: 16 bytes
    return _f16(blk) * (_nibble32(blk + 2, k % 32) - 8).to(tl.float32)


@triton.jit
def _q4_1(rowp, k):
    blk = rowp + (k // 32) * 20  # d, m: fp16, qs: 16 bytes
    return _f16(blk) * _nibble32(blk + 4, k % 32).to(tl.float32) + _f16(blk + 2)


@triton.jit
def _fifth_bit(qh, j):
    """Bit j of the little-endian uint32 at qh (the fifth bit of weight j in Q5_0/Q5_1)."""
    return (_u8(qh + j // 8) >> (j % 8)) & 1


@triton.jit
def _q5_0(rowp, k):
    blk = rowp + (k // 32) * 22  # d: fp16, qh: uint32, qs: 16 bytes
    j = k % 32
    q = _nibble32(blk + 6, j) | (_fifth_bit(blk + 2, j) << 4)
    return _f16(blk) * (q - 16).to(tl.float32)


@triton.jit
def _q5_1(rowp, k):
    blk = rowp + (k // 32) * 24  # d, m: fp16, qh: uint32, qs: 16 bytes
    j = k % 32
    q = _nibble32(blk + 8, j) | (_fifth_bit(blk + 4, j) << 4)
    return _f16(blk) * q.to(tl.float32) + _f16(blk + 2)


@triton.jit
def _q8_0(rowp, k):
    blk = rowp + (k // 32) * 34  # d: fp16, qs: 32 int8
    q = tl.load(blk + 2 + (k % 32)).to(tl.int8, bitcast=True)
    return q.to(tl.float32) * _f16(blk)


@triton.jit
def _mxfp4(rowp, k):
    blk = rowp + (k // 32) * 17  # e: E8M0 exponent, qs: 16 bytes of E2M1 codes
    code = _nibble32(blk + 1, k % 32)
    mag = code & 7  # E2M1 doubled: 0 1 2 3 4 6 8 12
    twice = tl.where(mag < 4, mag, tl.where(mag < 6, 2 * mag - 4, 4 * mag - 16))
    twice = tl.where(code >= 8, -twice, twice)
    # half the E8M0 scale, 2^(e - 128), built from its bits (e = 0 and 1 give fp32 subnormals), as
    # ggml_e8m0_to_fp32_half does
    e = _u8(blk)
    half = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    return half * twice.to(tl.float32)


@triton.jit
def _k_scale_min(sc, s):
    """6-bit scale and min of sub-block s (0..7) from the 12 packed bytes at sc (Q4_K, Q5_K):
    s < 4: sc[s] & 63, sc[s+4] & 63; else the low/high nibble of sc[s+4] with the top two bits of
    sc[s-4] / sc[s]."""
    a = _u8(sc + s)
    b = _u8(sc + s + 4)
    c = _u8(sc + s % 4)
    low = s < 4
    scale = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale, mn


@triton.jit
def _q4_k(rowp, k):
    blk = rowp + (k // 256) * 144  # d, dmin: fp16, scales: 12 bytes, qs: 128 bytes
    j = k % 256
    s = j // 32  # sub-block; 32-byte chunk j // 64 holds sub-blocks 2c (low) and 2c + 1 (high nibbles)
    scale, mn = _k_scale_min(blk + 4, s)
    q = (_u8(blk + 16 + (j // 64) * 32 + j % 32) >> ((s % 2) * 4)) & 15
    return (_f16(blk) * scale.to(tl.float32)) * q.to(tl.float32) - _f16(blk + 2) * mn.to(tl.float32)


@triton.jit
def _q5_k(rowp, k):
    blk = rowp + (k // 256) * 176  # d, dmin, scales: as Q4_K; qh: 32 bytes; qs: 128 bytes
    j = k % 256
    s = j // 32
    scale, mn = _k_scale_min(blk + 4, s)
    low = (_u8(blk + 48 + (j // 64) * 32 + j % 32) >> ((s % 2) * 4)) & 15
    q = low | (((_u8(blk + 16 + j % 32) >> s) & 1) << 4)  # bit s of qh[j % 32]
    return (_f16(blk) * scale.to(tl.float32)) * q.to(tl.float32) - _f16(blk + 2) * mn.to(tl.float32)


@triton.jit
def _q6_k(rowp, k):
    blk = rowp + (k // 256) * 210  # ql: 128 bytes, qh: 64 bytes, scales: 16 int8, d: fp16
    j = k % 256
    half = j // 128  # each half: ql 64 bytes (low nibbles then high), qh 32 bytes (2 bits x 4)
    i = j % 128
    low = (_u8(blk + half * 64 + i % 64) >> ((i // 64) * 4)) & 15
    high = (_u8(blk + 128 + half * 32 + i % 32) >> ((i // 32) * 2)) & 3
    scale = tl.load(blk + 192 + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
    return (_f16(blk + 208) * scale) * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _two_bits(qs, j):
    """2-bit field of weight j (0..255) in the 64 bytes at qs (Q2_K, Q3_K): each half of 128 weights
    is 32 bytes, weight 32 t + i at bits 2t of byte i."""
    i = j % 128
    return (_u8(qs + (j // 128) * 32 + i % 32) >> ((i // 32) * 2)) & 3


@triton.jit
def _q2_k(rowp, k):
    blk = rowp + (k // 256) * 84  # scales: 16 bytes (4-bit scale, 4-bit min), qs: 64, d, dmin: fp16
    j = k % 256
    sm = _u8(blk + j // 16)
    dl = _f16(blk + 80) * (sm & 15).to(tl.float32)
    ml = _f16(blk + 82) * (sm >> 4).to(tl.float32)
    return dl * _two_bits(blk + 16, j).to(tl.float32) - ml


@triton.jit
def _q3_k(rowp, k):
    blk = rowp + (k // 256) * 110  # hmask: 32 bytes, qs: 64, scales: 12 (16 x 6 bits), d: fp16
    j = k % 256
    t = j // 16
    low = (_u8(blk + 96 + t % 8) >> ((t // 8) * 4)) & 15
    high = (_u8(blk + 104 + t % 4) >> ((t // 4) * 2)) & 3
    dl = _f16(blk + 108) * ((low | (high << 4)) - 32).to(tl.float32)
    hbit = (_u8(blk + j % 32) >> (j // 32)) & 1  # a clear bit subtracts 4
    return dl * (_two_bits(blk + 32, j) - 4 * (1 - hbit)).to(tl.float32)


@triton.jit
def _iq4_nl(rowp, k, lut):
    blk = rowp + (k // 32) * 18  # d: fp16, qs: 16 bytes of indices into the 16-value table
    return _f16(blk) * tl.load(lut + _nibble32(blk + 2, k % 32))


@triton.jit
def _iq4_xs(rowp, k, lut):
    blk = rowp + (k // 256) * 136  # d: fp16, scales_h: uint16, scales_l: 4 bytes, qs: 128 bytes
    j = k % 256
    s = j // 32
    low = (_u8(blk + 4 + s // 2) >> ((s % 2) * 4)) & 15
    high = (((_u8(blk + 2) | (_u8(blk + 3) << 8)) >> (2 * s)) & 3) << 4
    dl = _f16(blk) * ((low | high) - 32).to(tl.float32)
    q = (_u8(blk + 8 + s * 16 + j % 16) >> (((j % 32) // 16) * 4)) & 15
    return dl * tl.load(lut + q)


@triton.jit
def decode(w_ptr, n, k, row_bytes, lut, QTYPE: tl.constexpr):
    """fp32 weights W[n, k] of the matrix at w_ptr (uint8), rows `row_bytes` apart; n and k are int
    tensors that broadcast to the tile's shape and must lie inside the matrix. `lut` points at
    IQ4_NL's 16 values as fp32 (read only by the IQ4 types)."""
    rowp = w_ptr + n.to(tl.int64) * row_bytes
    if QTYPE == Q4_0:
        w = _q4_0(rowp, k)
    elif QTYPE == Q4_1:
        w = _q4_1(rowp, k)
    elif QTYPE == Q5_0:
        w = _q5_0(rowp, k)
    elif QTYPE == Q5_1:
        w = _q5_1(rowp, k)
    elif QTYPE == Q8_0:
        w = _q8_0(rowp, k)
    elif QTYPE == MXFP4:
        w = _mxfp4(rowp, k)
    elif QTYPE == Q2_K:
        w = _q2_k(rowp, k)
    elif QTYPE == Q3_K:
        w = _q3_k(rowp, k)
    elif QTYPE == Q4_K:
        w = _q4_k(rowp, k)
    elif QTYPE == Q5_K:
        w = _q5_k(rowp, k)
    elif QTYPE == Q6_K:
        w = _q6_k(rowp, k)
    elif QTYPE == IQ4_NL:
        w = _iq4_nl(rowp, k, lut)
    else:
        tl.static_assert(QTYPE == IQ4_XS, "unknown ggml type")
        w = _iq4_xs(rowp, k, lut)
    return w

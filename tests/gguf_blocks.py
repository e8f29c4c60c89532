"""Valid random GGUF blocks of every type the GPU kernels read, and gguf's dequantization of them.

Types that `gguf.quants` can quantize are quantized from Gaussian weights; the others (the K-quants
and IQ4 types, which gguf only dequantizes) are random bytes with every fp16 scale field set to a
finite random value, since every other bit pattern of those blocks is a valid block.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from moestream.kernels.types import TYPES

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4")


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes] of valid `name` blocks for an [n, k] matrix."""
    qtype = GGMLQuantizationType[name]
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if name in QUANTIZABLE:
        return quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.05, qtype)
    raw = rng.integers(0, 256, size=(n, k // block, block_bytes), dtype=np.uint8)
    for offset in TYPES[name].fp16_at:
        scales = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        raw[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, k // block * block_bytes)


def reference(name: str, blocks: np.ndarray) -> np.ndarray:
    """gguf's fp32 dequantization of `blocks` [n, row_bytes] -> [n, k]."""
    return dequantize(blocks, GGMLQuantizationType[name])


def check_product(y, x, ref_w, dot: bool, rel_limit: float | None = None) -> float:
    """Assert y = x @ ref_w^T within the kernels' stated bounds (tests/test_kernels.py) and return the
    relative Frobenius error. y, x: torch tensors [M, N], [M, K]; ref_w: gguf's fp32 weights [N, K]."""
    ref = x.double() @ ref_w.double().T
    s = x.double().abs() @ ref_w.double().abs().T
    weight_term = (2**-8 if dot else 0.0) + x.shape[1] * 2**-23
    bound = 2**-8 * ref.abs() + 1.01 * weight_term * s + 1e-30
    excess = ((y.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"worst element off by {excess:.3g} beyond the bound"
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    limit = rel_limit if rel_limit is not None else (4e-3 if dot else 3e-3)
    assert rel < limit, rel
    return rel


def ggml_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray | None:
    """uint8 [n, row_bytes] quantized from Gaussian weights by ggml's own quantizer (moestream.ggml, the
    one llama-quantize uses), or None where that library cannot be loaded."""
    try:
        import torch

        from moestream import ggml

        g = torch.Generator().manual_seed(seed)
        blocks = ggml.quantize(torch.randn(n, k, generator=g) * 0.05, name)
    except Exception:  # no usable ggml here (it is optional for these tests)
        return None
    return blocks.numpy().reshape(n, -1)

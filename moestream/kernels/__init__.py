"""GPU kernels on GGUF blocks as stored (Triton), for experts and trunk weights kept quantized on the GPU.

Importing this package does not import triton (nor torch): the kernel functions below are loaded on
first use, and `available()` says whether they can be.

    from moestream import kernels
    y = kernels.matmul(x, w, "Q4_K", n)              # x [M, K] bf16, w uint8 GGUF bytes -> [M, n] bf16
    d = kernels.dequantize(w, "Q6_K", n, k)          # -> [n, k] bf16 (dtype=...), out=scratch to reuse
    y = kernels.linear(x, w, "Q4_K", n)              # either of the two, as kernels.choose(type, M) says
    y = kernels.grouped_matmul(x, slots, "Q4_K", n, offsets, starts, rows=rows, max_rows=m)
                                                     # several experts of one layer in one launch

Types: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4 (`TYPES`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from moestream.errors import MoestreamError
from moestream.kernels.choice import DEQUANT_FROM, Route, choose
from moestream.kernels.types import TYPES, BlockType, UnsupportedTypeError, block_type

_LAZY = ("matmul", "grouped_matmul", "dequantize", "linear", "KernelConfig", "default_config")

__all__ = [
    "DEQUANT_FROM",
    "TYPES",
    "BlockType",
    "KernelsUnavailableError",
    "Route",
    "UnsupportedTypeError",
    "available",
    "block_type",
    "choose",
    *_LAZY,
]


class KernelsUnavailableError(MoestreamError):
    """Triton (or a torch it works with) is not installed, so the GGUF GPU kernels cannot run."""


def available() -> bool:
    """Whether triton is installed (the kernels also need a CUDA GPU, or TRITON_INTERPRET=1 on the CPU)."""
    return importlib.util.find_spec("triton") is not None


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        ops = importlib.import_module("moestream.kernels.ops")
    except ImportError as exc:
        raise KernelsUnavailableError(
            f"the GGUF GPU kernels need Triton, which could not be imported ({exc}); "
            "install it with `pip install triton` (CUDA builds of torch bring it along)"
        ) from exc
    return getattr(ops, name)

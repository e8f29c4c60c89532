"""ggml's CPU kernels over GGUF blocks as stored, through a small ctypes binding of our own.

Nothing is loaded at import: the library is found, checked and dlopen'ed on first use (see `lib`).

    from moestream import ggml
    ggml.describe()                                   # 'ggml 0.20.2 prebuilt (AVX2)'
    y = ggml.linear(x, w_bytes, "Q4_K", rows)         # x [M, K] f32 -> [M, rows] f32
    y = ggml.swiglu_expert(x, g, u, d, ("Q4_K", "Q4_K", "Q6_K"), intermediate)
    w = ggml.dequantize(w_bytes, "Q6_K", rows, k)     # [rows, k] f32
    e = ggml.get_rows(table, "Q6_K", vocab, hidden, token_ids)  # [n, hidden] f32
    b = ggml.quantize(w, "Q4_K")                      # uint8 [rows * row_bytes(k)]
"""

from __future__ import annotations

from moestream.ggml.graphs import Kernels, compute_threads, kernels, set_threads
from moestream.ggml.lib import GgmlUnavailableError, Library, library
from moestream.ggml.ops import (
    WEIGHT_ALIGNMENT,
    dequantize,
    get_rows,
    linear,
    linear_experts,
    linear_id,
    quantize,
    swiglu,
    swiglu_expert,
    swiglu_oai,
)
from moestream.ggml.thresholds import dequant_threshold
from moestream.ggml.types import GgmlType, UnsupportedTypeError, ggml_type, row_bytes, type_table

__all__ = [
    "WEIGHT_ALIGNMENT",
    "GgmlType",
    "GgmlUnavailableError",
    "Kernels",
    "Library",
    "UnsupportedTypeError",
    "compute_threads",
    "dequant_threshold",
    "dequantize",
    "describe",
    "get_rows",
    "ggml_type",
    "kernels",
    "library",
    "linear",
    "linear_experts",
    "linear_id",
    "quantize",
    "row_bytes",
    "set_threads",
    "swiglu",
    "swiglu_expert",
    "swiglu_oai",
    "type_table",
]


def describe() -> str:
    """The loaded ggml for the mode line, e.g. 'ggml 0.25.3 native (AVX2, AVX512, ...)'."""
    return library().describe()

"""Rows per expert above which dequantize + bf16 F.linear beats ggml's mul_mat, per format and build.

Placeholder until benchmarks/ggml_kernels.py has run; see BENCHMARKS.md "ggml kernels".
"""
from __future__ import annotations

# build kind -> GGUF type name -> smallest M at which dequantize + bf16 F.linear was faster.
DEQUANT_THRESHOLD: dict[str, dict[str, int]] = {"prebuilt": {}, "native": {}}
NEVER = 1 << 30


def dequant_threshold(type_name: str, kind: str) -> int:
    """Smallest batch M per expert from which dequantize + bf16 F.linear is the faster route (else NEVER)."""
    return DEQUANT_THRESHOLD.get("native" if kind == "native" else "prebuilt", {}).get(type_name, NEVER)

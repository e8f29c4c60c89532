"""Rows per expert from which dequantize + bf16 F.linear beats ggml's mul_mat, per build, threads, format.

Measured by `benchmarks/ggml_kernels.py` (BENCHMARKS.md, "ggml kernels", run of 2026-12-01 11:48 UTC on
the 2-core AMD EPYC Zen 4 development VM, torch 2.13.0): a whole Qwen3-30B-A3B-shaped SwiGLU expert,
weights read from DRAM, M on the grid 1, 4, 16, 32, 64, 128, 256. A value is the first grid M from which
the dequantize route was faster at every larger M; None: ggml stayed faster up to 256 (native K-quants
and IQ4_XS, whose VNNI/llamafile kernels batch well). Another machine should re-run the benchmark.
"""

from __future__ import annotations

DEQUANT_THRESHOLD: dict[str, dict[int, dict[str, int | None]]] = {
    "prebuilt": {
        1: {"Q4_0": 16, "Q8_0": 16, "Q4_K": 32, "Q5_K": 16, "Q6_K": 64, "MXFP4": 32, "IQ4_XS": 64},
        2: {"Q4_0": 32, "Q8_0": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 128, "MXFP4": 32, "IQ4_XS": 128},
    },
    "native": {
        1: {"Q4_0": 64, "Q8_0": 32, "Q4_K": None, "Q5_K": None, "Q6_K": None, "MXFP4": 64, "IQ4_XS": None},
        2: {"Q4_0": 128, "Q8_0": 64, "Q4_K": None, "Q5_K": None, "Q6_K": None, "MXFP4": 64, "IQ4_XS": None},
    },
}
NEVER = 1 << 30


def dequant_threshold(type_name: str, kind: str, threads: int) -> int:
    """Smallest M (rows per expert) from which to dequantize + bf16 F.linear instead of ggml; NEVER if
    ggml was faster throughout or the format was not measured. `kind` is Library.kind ("custom" builds
    use the prebuilt figures); thread counts above the measured ones use the largest measured."""
    table = DEQUANT_THRESHOLD["native" if kind == "native" else "prebuilt"]
    measured = [t for t in table if t <= max(1, threads)]
    value = table[max(measured)].get(type_name)
    return NEVER if value is None else value

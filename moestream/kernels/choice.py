"""Which route computes x @ W^T for a GGUF type at M rows per matrix (plain Python: no torch, no triton).

  "direct":  the block kernel (`ops.matmul`), which decodes W in registers;
  "dequant": dequantize W into a scratch tensor (`ops.dequantize`), then torch's bf16 matmul.

DEQUANT_FROM[type] is the smallest M at which "dequant" is used. `benchmarks/cuda_kernels.py` measures
both routes per type and M on a GPU and prints this table to paste here, with the run it came from
(machine, date, command) named in the comment below. Types never measured keep the guess: the direct
kernel at decode sizes, dequantize + tensor-core matmul from M = 64.
"""

from __future__ import annotations

from typing import Literal

Route = Literal["direct", "dequant"]
NEVER = 1 << 30  # "dequant" is never faster (measured up to the largest M benchmarked)

# Measured by benchmarks/cuda_kernels.py on an NVIDIA H200 (torch 2.11.0+cu130, triton 3.6.0),
# 2026-12-01 14:45 UTC, M = 1, 4, 16, 64, 256 at the Qwen3-30B-A3B and gpt-oss expert shapes
# (`python benchmarks/cuda_kernels.py --json OUT`, BENCHMARKS.md "GGUF kernels on the H200"): the
# direct kernel won at every M for these types but Q5_0 (dequant from 64). Both routes are bound by
# the host's launch cost there (~50 us a Triton launch), so the table says more about launches than
# about the GPU. The types not in that run keep the guess (64) and are not in MEASURED_TYPES.
DEQUANT_FROM: dict[str, int] = {
    "Q4_0": NEVER,
    "Q4_1": 64,
    "Q5_0": 64,
    "Q5_1": 64,
    "Q8_0": NEVER,
    "Q2_K": 64,
    "Q3_K": 64,
    "Q4_K": NEVER,
    "Q5_K": NEVER,
    "Q6_K": NEVER,
    "IQ4_NL": 64,
    "IQ4_XS": 64,
    "MXFP4": NEVER,
}
MEASURED_TYPES = frozenset({"Q4_0", "Q8_0", "Q5_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"})


def choose(type_name: str, m: int) -> Route:
    """The route for `m` rows per matrix of a `type_name` (GGUF spelling) weight. A type missing from
    the table dequantizes (it was never measured against the direct kernel)."""
    return "dequant" if m >= DEQUANT_FROM.get(type_name, 0) else "direct"

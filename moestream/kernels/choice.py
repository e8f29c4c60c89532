"""Which route computes x @ W^T for a GGUF type at M rows per matrix (plain Python: no torch, no triton).

  "direct":  the block kernel (`ops.matmul`), which decodes W in registers;
  "dequant": dequantize W into a scratch tensor (`ops.dequantize`), then torch's bf16 matmul.

DEQUANT_FROM[type] is the smallest M at which "dequant" is used. PLACEHOLDER values: they were not
measured. `benchmarks/cuda_kernels.py` measures both routes per type and M on a GPU and prints this
table to paste here, with the run it came from (machine, date, command) named in this comment.
Until then the guess is: the direct kernel at decode sizes (M <= 8, where it reads W once and is
launch-bound), dequantize + tensor-core matmul from M = 64 for every type.
"""

from __future__ import annotations

from typing import Literal

Route = Literal["direct", "dequant"]
NEVER = 1 << 30  # "dequant" is never faster (measured up to the largest M benchmarked)

DEQUANT_FROM: dict[str, int] = {
    "Q4_0": 64,
    "Q4_1": 64,
    "Q5_0": 64,
    "Q5_1": 64,
    "Q8_0": 64,
    "Q2_K": 64,
    "Q3_K": 64,
    "Q4_K": 64,
    "Q5_K": 64,
    "Q6_K": 64,
    "IQ4_NL": 64,
    "IQ4_XS": 64,
    "MXFP4": 64,
}
MEASURED = False  # set True with the table pasted from a benchmark run


def choose(type_name: str, m: int) -> Route:
    """The route for `m` rows per matrix of a `type_name` (GGUF spelling) weight. A type missing from
    the table dequantizes (it was never measured against the direct kernel)."""
    return "dequant" if m >= DEQUANT_FROM.get(type_name, 0) else "direct"

"""ggml's tiled K-quant kernel, and the 7-row rule of a batch of sequences (issue 33, item 3).

ggml's CPU backend computes a matrix of a K-quant or IQ type (`TILED_TYPES`) over `TILED_ROWS` or more
rows of one node with its tiled kernel (`ggml-cpu/tiled/tiled.cpp`; a ggml_mul_mat_id: an expert's
rows in the node), and over fewer with vec_dot, row by row; the two round otherwise. A token decoded
alone is one row, so a batch of sequences gets each one's bits alone only where no node hands such a
matrix `TILED_ROWS` rows: the rule splits a batch step's T rows into `row_groups`, at most `ROWS` rows
each, every group its own product over the same weights (the graphs: `LayerGraphs.product`,
`LayerGraphs.routed`; the expert runtime: `SwitchLayer`). A shared matrix is then read once a group.

`MOESTREAM_GGML_BATCH_GROUPS=0` turns the rule off (the tiled kernel then takes a batch's products
from 8 rows, as ggml chooses); it is not needed, and not applied, where the loaded ggml has no tiled
kernel or where `GGML_CPU_TILED_MM=0` turns it off (ggml reads both switches once a process).
"""

from __future__ import annotations

import os
from functools import cache

from gguf.constants import GGMLQuantizationType

from moestream.ggml.lib import GgmlUnavailableError, library

GROUPS_ENV = "MOESTREAM_GGML_BATCH_GROUPS"
TILED_ROWS = 8  # ggml_tiled_min_batch: the tiled kernel from this many rows of a matrix in a node
ROWS = TILED_ROWS - 1  # the most rows of a tiled matrix a batch step's node takes under the rule
# the types of ggml_tiled_supported's switch (ggml 0.25.3)
TILED_TYPES = frozenset(
    GGMLQuantizationType[name].value
    for name in (
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ4_XS",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ3_XXS",
        "IQ3_S",
        "IQ1_S",
        "IQ1_M",
    )
)


def groups_wanted() -> bool:
    """MOESTREAM_GGML_BATCH_GROUPS: "1" or unset applies the rule, "0" does not; another value is refused."""
    value = os.environ.get(GROUPS_ENV, "")
    if value not in ("", "0", "1"):
        raise GgmlUnavailableError(f"{GROUPS_ENV}={value!r}: say 1 (groups of at most {ROWS} rows) or 0")
    return value != "0"


@cache
def tiled_kernel() -> bool:
    """Whether the loaded ggml takes its tiled kernel from `TILED_ROWS` rows on: it has one, built with
    AVX (without, ggml_tiled_supported says no to every matrix: an ARM build), and neither
    GGML_CPU_TILED_MM=0 (off) nor GGML_CPU_TILED_MM_FORCE=1 (at any rows) is set, as ggml reads them."""
    cpu = library().cpu
    if not hasattr(cpu, "ggml_compute_forward_mul_mat_tiled"):
        return False
    if not any(getattr(cpu, f"ggml_cpu_has_{isa}", lambda: 0)() for isa in ("avx", "avx2", "avx512")):
        return False
    enabled = _atoi(os.environ.get("GGML_CPU_TILED_MM", "1")) != 0
    forced = _atoi(os.environ.get("GGML_CPU_TILED_MM_FORCE", "0")) == 1
    return enabled and not forced


def split(type_ids: object, rows: int) -> bool:
    """Whether a batch step's product of `rows` rows over matrices of `type_ids` (one id or several)
    is split into `row_groups` under the rule."""
    ids = type_ids if isinstance(type_ids, (tuple, list, set, frozenset)) else (type_ids,)
    return rows >= TILED_ROWS and any(t in TILED_TYPES for t in ids) and groups_wanted() and tiled_kernel()


def row_groups(rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of ceil(rows / ROWS) groups, each of ROWS rows but the last (16 rows: 7, 7, 2).
    Full groups rather than even ones: an expert that rows of two groups share is read once for each,
    and the distinct experts of n rows grow slower than n, so fuller groups share fewer (on the 6 x 128
    synthetic, 8 rows as 7 + 1 cost 3% against ggml's tiled kernel, as 4 + 4 9%: BENCHMARKS.md)."""
    return [(first, min(ROWS, rows - first)) for first in range(0, rows, ROWS)]


def _atoi(text: str) -> int:
    """C's atoi: leading blanks, a sign and digits; 0 where none."""
    s = text.lstrip()
    sign = -1 if s[:1] == "-" else 1
    s = s[1:] if s[:1] in "+-" and s else s
    digits = len(s) - len(s.lstrip("0123456789"))
    return sign * int(s[:digits]) if digits else 0

"""Compile moestream's GGUF kernels ahead of time for a GPU architecture, without a GPU (Triton's
compiler and the ptxas it ships). Run as a script, in a process where TRITON_INTERPRET is unset:

    python tests/kernels_aot.py ARCH:NAME,NAME... ... -> one JSON line {"ARCH:NAME": "ok" | error}
"""

from __future__ import annotations

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moestream.kernels import TYPES
from moestream.kernels.ops import default_config
from moestream.kernels.triton_kernels import dequantize_kernel, matmul_kernel

MATMUL_SIGNATURE = {
    "x_ptr": "*bf16",
    "w_ptr": "*u8",
    "out_ptr": "*bf16",
    "lut_ptr": "*fp32",
    "offsets_ptr": "*i64",
    "starts_ptr": "*i32",
    "rows_ptr": "*i64",
    **dict.fromkeys(("M", "N", "K", "row_bytes", "stride_xm"), "i32"),
    **dict.fromkeys(("QTYPE", "BM", "BN", "BK", "DOT", "GROUPED", "HAS_ROWS", "INTERPRET"), "constexpr"),
}
DEQUANT_SIGNATURE = {
    "w_ptr": "*u8",
    "out_ptr": "*bf16",
    "lut_ptr": "*fp32",
    "ids_ptr": "*i32",
    **dict.fromkeys(("N", "K", "row_bytes"), "i32"),
    **dict.fromkeys(("QTYPE", "BN", "BK", "HAS_IDS", "INTERPRET"), "constexpr"),
}
# (rows per matrix, grouped): a decode GEMV, a grouped decode of 8 rows, a grouped prefill tile
CASES = ((1, False), (8, True), (64, True))


def _compile(fn, signature: dict, constexprs: dict, arch: int, num_warps: int) -> bytes:
    src = ASTSource(fn, signature, constexprs=constexprs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(src, target=target, options={"num_warps": num_warps}).asm["cubin"]


def compile_type(name: str, arch: int) -> None:
    """Every kernel variant `default_config` picks for the Qwen3-30B-A3B expert shape, and the
    dequantize kernel, for type `name`."""
    qtype = TYPES[name].id
    for m, grouped in CASES:
        cfg = default_config(m, 768, 2048, torch.bfloat16)
        tile = {"BM": cfg.block_m, "BN": cfg.block_n, "BK": cfg.block_k, "DOT": cfg.dot}
        flags = {"GROUPED": grouped, "HAS_ROWS": grouped, "INTERPRET": False}
        assert _compile(
            matmul_kernel, MATMUL_SIGNATURE, {"QTYPE": qtype, **tile, **flags}, arch, cfg.num_warps
        )
    for has_ids in (False, True):
        dequant = {"QTYPE": qtype, "BN": 8, "BK": 256, "HAS_IDS": has_ids, "INTERPRET": False}
        assert _compile(dequantize_kernel, DEQUANT_SIGNATURE, dequant, arch, 4)


def main(argv: list[str]) -> None:
    results = {}
    for group in argv:
        arch, names = group.split(":")
        for name in names.split(","):
            try:
                compile_type(name, int(arch))
                results[f"{arch}:{name}"] = "ok"
            except Exception as exc:  # reported to the test, which names the type
                results[f"{arch}:{name}"] = f"{type(exc).__name__}: {exc}"[:2000]
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Error of the GGUF GPU kernels: relative Frobenius error of x @ W^T against the fp64 product over gguf's
own dequantization of the same bytes (bf16 x ~ N(0, 1)), per type and rows per matrix M, for the direct
kernel and for dequantize + torch matmul. Needs gguf. On a GPU at the expert shapes of Qwen3-30B-A3B
(768 x 2048, K-quants) and gpt-oss (2880 x 2880, 32-weight types); with --small on the CPU in Triton's
interpreter (TRITON_INTERPRET=1) at 40 x 512.

    python benchmarks/kernel_error.py [--small] [--m 1,5,20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_blocks import random_blocks, reference

from moestream import kernels
from moestream.kernels import TYPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="40 x 512 on the CPU (Triton interpreter)")
    ap.add_argument("--m", default="1,5,20", help="rows per matrix, comma-separated")
    args = ap.parse_args()
    device = "cpu" if args.small else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: use --small with TRITON_INTERPRET=1")
    ms = [int(v) for v in args.m.split(",")]
    print("| type | N x K | " + " | ".join(f"M={m} direct | M={m} dequant+mm" for m in ms) + " |")
    print("|---|---|" + "---|---|" * len(ms))
    for name, bt in TYPES.items():
        n, k = (40, 512) if args.small else (768, 2048) if bt.block == 256 else (2880, 2880)
        blocks = random_blocks(name, n, k)
        w = torch.from_numpy(blocks).reshape(-1).to(device)
        ref_w = torch.from_numpy(reference(name, blocks)).to(device).double()
        cells = []
        for m in ms:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(device)
            ref = x.double() @ ref_w.T
            for route in ("direct", "dequant"):
                y = kernels.linear(x, w, name, n, route=route).double()
                cells.append(f"{((y - ref).norm() / ref.norm()).item():.2e}")
        print(f"| {name} | {n} x {k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

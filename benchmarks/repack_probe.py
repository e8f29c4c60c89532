"""What ggml's repacked Q4_K kernels would give moestream's MoE products on the CPU (issue 33, issue 31's
CPU half): one layer's routed experts, ggml_mul_mat_id over a GGUF's Q4_K expert tensor as moestream's
graphs compute it today (the blocks as stored) and the same tensor in ggml's CPU "extra" buffer type
(`CPU_REPACK`: its set_tensor interleaves 8 rows' blocks, `q4_K_8x8`, and its kernels
`ggml_gemv/gemm_q4_K_8x8_q8_K` take the product), which llama.cpp uses by default (`--no-repack` turns it
off). Both through moestream's ggml binding and compute pool; T tokens, each with K distinct experts of E.

    python benchmarks/repack_probe.py MODEL.gguf [--tensor blk.0.ffn_gate_exps.weight] [--tokens 1,4,16]
                                      [--threads 2] [--calls 200]

A 2D tensor (`blk.0.attn_q.weight`) is taken by ggml_mul_mat, each token once.
Prints per token count: microseconds a call, stored against repacked, and the outputs' largest
difference over their largest magnitude (the repacked kernels sum in another order). A probe, not the
engine: the expert cache's slots are not in that buffer type (a slot is written by O_DIRECT reads and
copied to a GPU tier as stored).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moestream import ggml
from moestream.ggml.graphs import kernels
from moestream.ggml.net import F32, I32, Arena, Net
from moestream.ggml.repack import Repacker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--tensor", default="blk.0.ffn_gate_exps.weight")
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--k", type=int, default=8, help="experts per token")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--each", action="store_true", help="each of a token's experts its own input (a down's)")
    args = p.parse_args()

    t = next(x for x in GGUFReader(args.model).tensors if x.name == args.tensor)
    shape = [int(n) for n in t.shape]
    cols, rows, experts = shape + [1] * (3 - len(shape))  # a 2D tensor (the trunk's): ggml_mul_mat
    raw = torch.from_numpy(np.ascontiguousarray(t.data).reshape(-1).copy())  # the blocks as stored
    lib = ggml.library()
    kern = kernels(args.threads)
    repacker = Repacker(lib)  # ggml's CPU_REPACK buffer type, from the CPU backend's registry
    buffer, base = repacker.alloc(raw.numel())
    type_id = int(t.tensor_type)
    print(f"{args.tensor}: {t.tensor_type.name} [{cols}, {rows}, {experts}], {raw.numel() / 2**20:.1f} MiB")
    gen = torch.Generator().manual_seed(0)
    try:
        for T in [int(x) for x in args.tokens.split(",")]:
            x = torch.randn(T, cols, generator=gen)
            k = args.k if len(shape) == 3 else 1
            xe = torch.randn(T, k, cols, generator=gen)
            ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
            outs, times = {}, {}
            for way in ("stored", "repacked"):
                out = torch.zeros(T, k, rows)
                net = Net(lib, nodes=16)
                if way == "stored":
                    w = net.tensor(type_id, shape, raw.data_ptr())
                else:  # written into the repack buffer in its type's repacked layout, marked with its kernels
                    extra = repacker.repack(net.tensor(type_id, shape), buffer, base, raw.data_ptr())
                    if not extra:
                        raise SystemExit(f"{t.tensor_type.name} has no repacked kernels in this ggml build")
                    w = net.tensor(type_id, shape, base)
                    Repacker.mark(w, buffer, extra)
                if len(shape) == 3 and args.each:  # each expert its own input (a down's: [I, K, T])
                    xt = net.tensor(F32, [cols, k, T], xe.data_ptr())
                    y = net.mul_mat_id(w, xt, net.tensor(I32, [k, T], ids.data_ptr()))
                elif len(shape) == 3:
                    xt = net.tensor(F32, [cols, 1, T], x.data_ptr())
                    y = net.mul_mat_id(w, xt, net.tensor(I32, [k, T], ids.data_ptr()))
                else:
                    y = net.mul_mat(w, net.tensor(F32, [cols, T], x.data_ptr()))
                net.finish([net.fix(y, out.data_ptr())], args.threads, kern.pool)
                arena = Arena([net])
                with kern._lock, kern.hold():
                    net.run()
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        net.run()
                    times[way] = (time.perf_counter() - start) / args.calls * 1e6
                outs[way] = out.clone()
                arena.close()
                net.close()
            diff = (outs["stored"] - outs["repacked"]).abs().max().item() / outs["stored"].abs().max().item()
            print(
                f"T={T:>3}: stored {times['stored']:9.1f} us, repacked {times['repacked']:9.1f} us "
                f"({times['stored'] / times['repacked']:.2f}x), outputs' difference {diff:.2e}"
            )
    finally:
        repacker.close()


if __name__ == "__main__":
    main()

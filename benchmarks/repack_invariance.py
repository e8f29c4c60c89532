"""Whether one token's product is the same alone and beside others (issue 33, batch invariance), through
ggml's repacked Q4_K kernels (MOESTREAM_GGML_REPACK=1: the `CPU_REPACK` buffer type, `q4_K_8x8`) and
through the blocks as stored (the default).

    python benchmarks/repack_invariance.py MODEL.gguf [--tensors blk.0.ffn_gate_exps,blk.0.attn_q]
                                           [--tokens 1,2,3,4,5,8] [--others shared,random] [--threads 2]

For each tensor, one probe row (a token's activations, and for an expert tensor its K expert ids) is
computed alone (T=1) and then inside batches of T rows, at every position 0..T-1 of the batch, the other
rows random; each way's T-row output at the probe's position is compared bit for bit with that way's
T=1 output. The ops are those moestream's CPU graphs compute:

- an expert tensor (3D): ggml_mul_mat_id, the probe's expert ids the same in every batch; the other
  rows' ids the probe's (`shared`: every expert the probe uses gets T rows) or random (`random`); a
  down's input is one vector per expert (`[I, K, T]`), a gate's or up's one per token;
- a trunk tensor (2D, e.g. attn_q): the T=1 result is ggml_mul_mat's (a token decoded alone, as
  `LayerGraphs.product` computes it); the batches both through ggml_mul_mat (`mul_mat`) and through
  ggml_mul_mat_id over the one matrix, every row's id 0 (`mm_id`: what `LayerGraphs.product` does for a
  batch of sequences), T=1 included.

ggml's repacked ggml_mul_mat takes `gemm` for each full group of 4 rows (their activations quantized
together, `ggml_quantize_mat_q8_K_4x8`) and `gemv` for the rest; its ggml_mul_mat_id takes `gemv` row by
row. The stored blocks take `vec_dot` row by row (Q4_K has no llamafile sgemm) up to 7 rows of one
matrix, and ggml's tiled K-quant kernel (ggml-cpu/tiled, Q2_K-Q6_K and IQ types) from 8 rows on: all
rows of a ggml_mul_mat, an expert's rows of a ggml_mul_mat_id (`GGML_CPU_TILED_MM=0` in the environment
turns it off, `GGML_CPU_TILED_MM_FORCE=1` takes it at any rows).

Prints a table: per tensor, op and way, each T's cell `=` (every position bit-equal to T=1), or the
largest absolute difference over the positions, that over the T=1 output's largest magnitude, and which
positions differ. A type without repacked kernels (Q6_K) says so. Also checks that T=1 gives the same
bits twice. Seconds on 2 cores for the default tensors of a Qwen3-30B-A3B-shaped Q4_K_M.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moestream import ggml
from moestream.ggml.graphs import kernels
from moestream.ggml.net import F32, I32, Arena, Net
from moestream.ggml.repack import Repacker


class Product:
    """One graph of T rows over one weight (stored or repacked): fill `x` (and `ids`), `run()`, read
    `out` [T, K, rows]."""

    def __init__(self, w: tuple, op: str, T: int, k: int, each: bool, threads: int) -> None:
        type_id, shape, address, mark = w
        cols, rows = shape[0], shape[1]
        lib = ggml.library()
        self.kern = kernels(threads)
        self.net = Net(lib, nodes=16)
        net = self.net
        self.x = torch.zeros(T, k if each else 1, cols)
        self.ids = torch.zeros(T, k, dtype=torch.int32)
        self.out = torch.zeros(T, k, rows)
        if op == "mul_mat":
            wt = net.tensor(type_id, [cols, rows], address)
        else:
            wt = net.tensor(type_id, [cols, rows, shape[2] if len(shape) == 3 else 1], address)
        if mark is not None:
            Repacker.mark(wt, *mark)
        if op == "mul_mat":
            y = net.mul_mat(wt, net.tensor(F32, [cols, T], self.x.data_ptr()))
        else:
            xt = net.tensor(F32, [cols, k if each else 1, T], self.x.data_ptr())
            y = net.mul_mat_id(wt, xt, net.tensor(I32, [k, T], self.ids.data_ptr()))
        net.finish([net.fix(y, self.out.data_ptr())], threads, self.kern.pool)
        self.arena = Arena([net])

    def run(self) -> torch.Tensor:
        with self.kern._lock, self.kern.hold():
            self.net.run()
        return self.out.clone()

    def close(self) -> None:
        self.arena.close()
        self.net.close()


def check(reader: GGUFReader, name: str, args, repacker: Repacker, buffer: int, base: int) -> list[str]:
    """The table's lines of one tensor."""
    if not name.endswith(".weight"):
        name += ".weight"
    t = next((x for x in reader.tensors if x.name == name), None)
    if t is None:
        raise SystemExit(f"{name}: no such tensor in the GGUF")
    shape = [int(n) for n in t.shape]
    expert = len(shape) == 3
    cols = shape[0]
    experts = shape[2] if expert else 1
    each = expert and "down" in name  # a down's input: one vector per expert of the token
    k = args.k if expert else 1
    type_id = int(t.tensor_type)
    raw = torch.from_numpy(np.ascontiguousarray(t.data).reshape(-1).copy())  # the blocks as stored
    weights = {"stored": (type_id, shape, raw.data_ptr(), None)}
    lines = [f"{name}: {t.tensor_type.name} {shape}" + (f", K={k} experts a row" if expert else "")]
    net = Net(ggml.library(), nodes=2)
    try:
        extra = repacker.repack(net.tensor(type_id, shape), buffer, base, raw.data_ptr())
    finally:
        net.close()
    if extra:
        weights["repacked"] = (type_id, shape, base, (buffer, extra))
    else:
        lines.append(f"  {t.tensor_type.name} has no repacked kernels in this ggml build: stored only")

    gen = torch.Generator().manual_seed(0)
    probe_x = torch.randn(k if each else 1, cols, generator=gen)
    probe_ids = torch.randperm(experts, generator=gen)[:k].to(torch.int32)
    tokens = [int(x) for x in args.tokens.split(",")]
    ops = ["mm_id"] if expert else ["mul_mat", "mm_id"]
    others = args.others.split(",") if expert else ["-"]
    for way, w in weights.items():
        alone = Product(w, "mul_mat" if not expert else "mm_id", 1, k, each, args.threads)
        alone.x[0], alone.ids[0] = probe_x, probe_ids
        ref = alone.run()[0]
        again = alone.run()[0]
        alone.close()
        scale = ref.abs().max().item()
        if not torch.equal(ref, again):
            lines.append(f"  {way}: T=1 run twice differs by {(ref - again).abs().max().item():.3e}!")
        for op in ops:
            for mode in others:
                cells = []
                for T in tokens:
                    p = Product(w, op, T, k, each, args.threads)
                    worst, differ = 0.0, []
                    for pos in range(T):
                        p.x.copy_(torch.randn(p.x.shape, generator=gen))
                        if mode == "random":
                            p.ids.copy_(
                                torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(T)])
                            )
                        else:
                            p.ids[:] = probe_ids
                        p.x[pos], p.ids[pos] = probe_x, probe_ids
                        got = p.run()[pos]
                        if not torch.equal(got, ref):
                            differ.append(pos)
                            worst = max(worst, (got - ref).abs().max().item())
                    p.close()
                    cells.append(
                        "="
                        if not differ
                        else f"{worst:.2e} ({worst / scale:.0e} rel) @{_positions(differ, T)}"
                    )
                label = f"{way:8} {op:7}" + (f" ids {mode:6}" if expert else "")
                lines.append(f"  {label} | " + " | ".join(f"T={T}: {c}" for T, c in zip(tokens, cells)))
    return lines


def _positions(differ: list[int], T: int) -> str:
    return "all" if len(differ) == T else ",".join(str(p) for p in differ)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument(
        "--tensors",
        default="blk.0.ffn_gate_exps,blk.0.ffn_down_exps,blk.0.attn_q,blk.0.attn_output",
        help="comma-separated tensor names (.weight may be left off)",
    )
    p.add_argument(
        "--tokens", default="1,2,3,4,5,8", help="batch sizes T (1: the probe alone again, a fresh graph)"
    )
    p.add_argument("--others", default="shared,random", help="the other rows' expert ids: shared, random")
    p.add_argument("--k", type=int, default=8, help="experts per token")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    reader = GGUFReader(args.model)
    names = args.tensors.split(",")
    largest = max(
        (
            int(x.n_bytes)
            for x in reader.tensors
            if x.name in names or x.name.removesuffix(".weight") in names
        ),
        default=1,
    )
    repacker = Repacker(ggml.library())
    buffer, base = repacker.alloc(largest)  # each tensor repacked into it in turn
    print(f"{args.model}: each cell: = (bit-equal to T=1 at every position), else max |diff| @ positions")
    try:
        with repacker.quiet():
            for name in names:
                print("\n".join(check(reader, name, args, repacker, buffer, base)), flush=True)
    finally:
        repacker.close()


if __name__ == "__main__":
    main()

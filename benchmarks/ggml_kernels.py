"""ms per SwiGLU expert: ggml on GGUF blocks vs bf16 F.linear vs dequantize + bf16 F.linear, side by side.

Qwen3-30B-A3B's expert shape (gate/up [768, 2048], down [2048, 768]); M rows per expert; each candidate's
weights rotate through more than 96 MiB of distinct copies, so every call reads its weights from DRAM
like a freshly streamed expert. Candidates run in blocks of calls, in a shuffled order each round; a
block's time is the median of its per-call times, a candidate's the median over rounds, and its ratio
the median over rounds of (its block / the bf16 block of the same M in the same round).

Routes: `ggml` = one swiglu_expert graph (threadpool paused after each call, the default), `ggml held`
= the same inside Kernels.hold() (workers poll between calls), `dequant` = ggml dequantize of the three
matrices to f32, .to(bf16), then the bf16 expert. The crossover per format is the smallest M of the grid
from which `dequant` beats `ggml` at that M and every larger one.

    python benchmarks/ggml_kernels.py [--lib both|prebuilt|native] [--threads 1,2] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

FORMATS = ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "IQ4_XS"]
MS = [1, 4, 16, 32, 64, 128, 256]
H, INTER = 2048, 768
POOL_BYTES = 96 << 20


def copies(nbytes: int) -> int:
    return POOL_BYTES // nbytes + 2


def quant_pool(fmt: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    from moestream import ggml

    g, u, d = (torch.randn(r, k) * 0.02 for r, k in ((INTER, H), (INTER, H), (H, INTER)))
    qg, qu, qd = ggml.quantize(g, fmt), ggml.quantize(u, fmt), ggml.quantize(d, fmt)
    n = copies(qg.numel() + qu.numel() + qd.numel())
    return [(qg.clone(), qu.clone(), qd.clone()) for _ in range(n)]


def bf16_pool() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g, u, d = (torch.randn(r, k).mul_(0.02).bfloat16() for r, k in ((INTER, H), (INTER, H), (H, INTER)))
    return [(g.clone(), u.clone(), d.clone()) for _ in range(copies(3 * INTER * H * 2))]


def bf16_expert(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w[0])) * F.linear(x, w[1]), w[2])


class Dequant:
    """dequantize + bf16 F.linear into buffers made once (what a prefill fallback would do)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.f32 = [torch.empty(r, k) for r, k in ((INTER, H), (INTER, H), (H, INTER))]
        self.bf = [torch.empty(r, k, dtype=torch.bfloat16) for r, k in ((INTER, H), (INTER, H), (H, INTER))]

    def __call__(self, x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from moestream import ggml

        for data, f, b, (r, k) in zip(w, self.f32, self.bf, ((INTER, H), (INTER, H), (H, INTER))):
            ggml.dequantize(data, self.fmt, r, k, out=f)
            b.copy_(f)
        return bf16_expert(x.bfloat16(), self.bf)


def block(fn, pool: list, x: torch.Tensor, calls: int, start: int) -> float:
    """Median seconds per call over `calls` calls, each on the next copy of the weights."""
    times = []
    for i in range(calls):
        w = pool[(start + i) % len(pool)]
        t0 = time.perf_counter()
        fn(x, w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def candidates(formats: list[str], ms: list[int]) -> tuple[dict, dict]:
    """name -> (callable, pool, x) for every (route, format, M); pools are shared across M."""
    from moestream import ggml

    pools = {fmt: quant_pool(fmt) for fmt in formats}
    pools["bf16"] = bf16_pool()
    cands = {}
    for m in ms:
        x = torch.randn(m, H)
        cands[("bf16", "bf16", m)] = (bf16_expert, pools["bf16"], x.bfloat16())
        for fmt in formats:

            def run(x, w, fmt=fmt):
                return ggml.swiglu_expert(x, w[0], w[1], w[2], fmt, INTER)

            cands[("ggml", fmt, m)] = (run, pools[fmt], x)
            cands[("ggml held", fmt, m)] = (run, pools[fmt], x)
            cands[("dequant", fmt, m)] = (Dequant(fmt), pools[fmt], x)
    return cands, pools


def measure(threads: int, formats: list[str], ms: list[int], rounds: int) -> dict:
    """{(route, fmt, M): {"ms": median ms, "ratio": median ratio to bf16 at M}} for one thread count."""
    from moestream import ggml

    torch.set_num_threads(threads)
    cands, _ = candidates(formats, ms)
    per_round: dict[tuple, list[float]] = {key: [] for key in cands}
    rng = random.Random(threads)
    for rnd in range(rounds + 1):  # round 0 warms up (graphs, pages, caches) and is dropped
        order = list(cands)
        rng.shuffle(order)
        for key in order:
            fn, pool, x = cands[key]
            calls = 12 if key[2] <= 16 else 6
            with ggml.kernels().hold() if key[0] == "ggml held" else nullcontext():
                t = block(fn, pool, x, calls, rng.randrange(len(pool)))
            if rnd:
                per_round[key].append(t)
            time.sleep(0.003)
    out = {}
    for key, ts in per_round.items():
        base = per_round[("bf16", "bf16", key[2])]
        out[key] = {
            "ms": 1e3 * statistics.median(ts),
            "ratio": statistics.median(t / b for t, b in zip(ts, base)),
        }
    return out


def crossover(res: dict, fmt: str, ms: list[int]) -> int | None:
    """Smallest M from which dequant is faster than ggml at every M of the grid from there on."""
    best = None
    for m in reversed(ms):
        if res[("dequant", fmt, m)]["ms"] < res[("ggml", fmt, m)]["ms"]:
            best = m
        else:
            break
    return best


def run_one(args: argparse.Namespace) -> dict:
    from moestream import ggml

    lib = ggml.library()
    result = {"lib": lib.kind, "describe": lib.describe(), "threads": {}, "load_before": os.getloadavg()[0]}
    for t in args.threads:
        res = measure(t, args.formats, MS, args.rounds)
        result["threads"][str(t)] = {
            "cells": {"|".join(map(str, k)): v for k, v in res.items()},
            "crossover": {f: crossover(res, f, MS) for f in args.formats},
        }
    result["load_after"] = os.getloadavg()[0]
    return result


def table(result: dict, threads: int, formats: list[str]) -> str:
    cells = result["threads"][str(threads)]["cells"]
    cross = result["threads"][str(threads)]["crossover"]
    shown = [1, 4, 16, 64]
    head = "| route | " + " | ".join(f"M={m}" for m in shown) + " | dequant faster from M |"
    lines = [
        f"**{result['describe']}, {threads} thread(s)**: ms per expert (x bf16 at the same M); "
        f"1-min load average {result['load_before']:.2f} before, {result['load_after']:.2f} after",
        "",
        head,
        "|" + "---|" * (len(shown) + 2),
    ]
    bf = [cells[f"bf16|bf16|{m}"]["ms"] for m in shown]
    lines.append("| bf16 F.linear | " + " | ".join(f"{v:.3f}" for v in bf) + " | |")
    for fmt in formats:
        for route in ("ggml", "ggml held", "dequant"):
            vals = [cells[f"{route}|{fmt}|{m}"] for m in shown]
            extra = (str(cross[fmt]) if cross[fmt] else f"> {MS[-1]}") if route == "ggml" else ""
            lines.append(
                f"| {fmt} {route} | "
                + " | ".join(f"{v['ms']:.3f} ({v['ratio']:.2f})" for v in vals)
                + f" | {extra} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", default="both", choices=["both", "prebuilt", "native"])
    p.add_argument("--threads", default="1,2", type=lambda s: [int(v) for v in s.split(",")])
    p.add_argument("--formats", default=",".join(FORMATS), type=lambda s: s.split(","))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_one(args)))
        return
    from moestream.ggml.host import native_dir

    libs = ["prebuilt", "native"] if args.lib == "both" else [args.lib]
    results = []
    for lib in libs:
        env = dict(os.environ, MOESTREAM_GGML_LIB="prebuilt" if lib == "prebuilt" else str(native_dir()))
        argv = [
            sys.executable,
            __file__,
            "--child",
            "--threads",
            ",".join(map(str, args.threads)),
            "--formats",
            ",".join(args.formats),
            "--rounds",
            str(args.rounds),
        ]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{lib} run failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cpu = platform.processor() or platform.machine()
    print(
        f"date {time.strftime('%Y-%m-%d %H:%M %Z')} | {platform.node()} | {cpu} | torch {torch.__version__}"
        f" | rounds {args.rounds}"
    )
    for res in results:
        for t in args.threads:
            print()
            print(table(res, t, args.formats))
    print(
        "\nDEQUANT_THRESHOLD = "
        + json.dumps(
            {r["lib"]: {t: r["threads"][str(t)]["crossover"] for t in args.threads} for r in results}
        )
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""GGUF block kernels on a CUDA GPU: the direct kernel, dequantize + torch matmul, bf16 torch matmul (and
torch's tinygemm int4 for the 4-bit types), side by side in one run, at the expert shapes of
Qwen3-30B-A3B (gate/up 768 x 2048, down 2048 x 768) and gpt-oss (2880 x 2880), M = 1, 4, 16, 64, 256
rows per matrix; then one layer of experts in one grouped launch against one launch per expert.

Method: CUDA events around a loop of calls, each call on the next copy of the weights in a pool of
more than --pool-mib MiB (every candidate reads its weights from HBM, as a freshly copied expert
would, not from the 60 MB L2); warm-up calls first (they also compile); rounds alternate between
the candidates and the median round is reported. A time per call is what the GPU took per call
in a back-to-back stream, so it includes the host's launch cost wherever the host is the slower side
(the host time per call is printed too). Weights are valid random blocks (finite fp16 scales).

    python benchmarks/cuda_kernels.py            # ~1 minute on an H200 (Triton compiles included)
    python benchmarks/cuda_kernels.py --quick    # fewer types, M and rounds
    python benchmarks/cuda_kernels.py --tune     # also compare tile shapes of the direct kernel

Prints a Markdown table, then `DEQUANT_FROM` for moestream/kernels/choice.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moestream import kernels
from moestream.kernels import TYPES, KernelConfig
from moestream.kernels.choice import NEVER

SHAPES = {"gate/up 768x2048": (768, 2048), "down 2048x768": (2048, 768), "gpt-oss 2880x2880": (2880, 2880)}
DEFAULT_TYPES = ("Q4_0", "Q8_0", "Q5_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K")
ALL_M = (1, 4, 16, 64, 256)
LAYER_SHAPES = {"Q4_K": (1536, 2048), "Q6_K": (2048, 768)}  # fused gate+up, down
DEVICE = "cuda"  # "cpu" with --smoke: Triton's interpreter, tiny shapes, to check that the script runs


def random_blocks(name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Valid `name` blocks for [n, k] on the GPU: random bytes, finite fp16 scales, MXFP4 exponents
    near 2^0 (flat uint8 [n * row_bytes])."""
    bt = TYPES[name]
    blocks = torch.randint(
        0, 256, (n * k // bt.block, bt.block_bytes), dtype=torch.uint8, device=DEVICE, generator=gen
    )
    for at in bt.fp16_at:
        scales = (torch.randn(blocks.shape[0], device=DEVICE, generator=gen) * 0.01).to(torch.float16)
        blocks[:, at : at + 2] = scales.view(torch.uint8).view(-1, 2)
    if name == "MXFP4":
        blocks[:, 0] = 120 + blocks[:, 0] % 8
    return blocks.reshape(-1)


def pool_of(one: torch.Tensor, pool_bytes: int) -> list[torch.Tensor]:
    """Copies of `one` filling at least pool_bytes, each its own allocation-free view of one buffer."""
    count = max(2, -(-pool_bytes // (one.numel() * one.element_size())))
    flat = one.reshape(1, -1).repeat(count, 1)
    return [flat[i].view(one.shape) for i in range(count)]


def time_rounds(cands: dict[str, Callable[[int], object]], iters: int, rounds: int) -> dict[str, tuple]:
    """name -> (median GPU us per call, median host us per call) over `rounds` alternating rounds."""
    gpu: dict[str, list[float]] = {name: [] for name in cands}
    host: dict[str, list[float]] = {name: [] for name in cands}
    for fn in cands.values():
        for i in range(3):
            fn(i)
    _sync()
    for _ in range(rounds):
        for name, fn in cands.items():
            start, end = _event(), _event()
            t0 = time.perf_counter()
            start.record()
            for i in range(iters):
                fn(i)
            end.record()
            t1 = time.perf_counter()
            end.synchronize()
            gpu[name].append(start.elapsed_time(end) * 1000 / iters)
            host[name].append((t1 - t0) * 1e6 / iters)
    return {name: (statistics.median(gpu[name]), statistics.median(host[name])) for name in cands}


class _HostEvent:
    """--smoke's stand-in for a CUDA event: host time."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1000


def _event():
    return torch.cuda.Event(enable_timing=True) if DEVICE == "cuda" else _HostEvent()


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter, --smoke)"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def tinygemm(n: int, k: int, pool_bytes: int) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """torch's int4 tinygemm (group 32, bf16 scales) on packed random weights: the speed reference of
    an int4 route (its packing is not GGUF's); None where this torch or shape has no kernel."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=DEVICE)
    packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    sz = torch.randn(k // 32, n, 2, dtype=torch.bfloat16, device=DEVICE) * 0.01
    x = torch.zeros(1, k, dtype=torch.bfloat16, device=DEVICE)
    for inner in (8, 4, 2):
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, inner)
            torch.ops.aten._weight_int4pack_mm(x, packed, 32, sz)
            break
        except (RuntimeError, NotImplementedError, TypeError):
            continue
    else:
        return None
    pool = pool_of(packed, pool_bytes)
    return lambda x, i: torch.ops.aten._weight_int4pack_mm(x, pool[i % len(pool)], 32, sz)


def _candidates(name: str, n: int, k: int, x: torch.Tensor, pools: dict, int4) -> dict[str, Callable]:
    """The routes for one (type, shape, M), each a function of the call number."""
    w, dense, scratch = pools["w"], pools["dense"], pools["scratch"]
    cands = {
        "direct": lambda i: kernels.matmul(x, w[i % len(w)], name, n),
        "dequant": lambda i: x @ kernels.dequantize(w[i % len(w)], name, n, k, out=scratch).T,
        "bf16": lambda i: x @ dense[i % len(dense)].T,
    }
    if int4 is not None:
        cands["tinygemm"] = lambda i: int4(x, i)
    return cands


def bench_shape(name: str, label: str, ms: tuple[int, ...], args, gen) -> list[dict]:
    n, k = SHAPES[label]
    pool_bytes = args.pool_mib << 20
    one = random_blocks(name, n, k, gen)
    pools = {
        "w": pool_of(one, pool_bytes),
        "dense": pool_of(torch.randn(n, k, device=DEVICE, generator=gen).to(torch.bfloat16), pool_bytes),
        "scratch": torch.empty(n, k, dtype=torch.bfloat16, device=DEVICE),
    }
    int4 = tinygemm(n, k, pool_bytes) if name in ("Q4_0", "Q4_K") else None
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        direct = kernels.matmul(x, one, name, n).float()
        via = (x @ kernels.dequantize(one, name, n, k).T).float()
        rel = ((direct - via).norm() / via.norm()).item()
        if not rel < 1e-2:
            raise SystemExit(f"{name} {label} M={m}: direct and dequantize routes differ by {rel:.3g}")
        times = time_rounds(_candidates(name, n, k, x, pools, int4), args.iters, args.rounds)
        row = {"type": name, "shape": label, "m": m, "rel": rel, "host_direct": times["direct"][1]}
        rows.append(row | {c: t for c, (t, _) in times.items()})
    return rows


class _Layer:
    """One Qwen3-30B-A3B MoE layer's matmul of one kind for `tokens` tokens routed top-8 of 128: the
    routed experts' matrices in 256-byte-aligned slots of one GPU buffer (copies of the layer rotate
    through the pool), the token-expert pairs sorted by expert."""

    def __init__(self, name: str, n: int, k: int, tokens: int, pool_bytes: int, gen) -> None:
        cpu = torch.Generator().manual_seed(tokens)
        picks = torch.stack([torch.randperm(128, generator=cpu)[:8] for _ in range(tokens)])  # [T, 8]
        experts, inverse = torch.unique(picks.reshape(-1), return_inverse=True)
        counts = torch.bincount(inverse, minlength=len(experts))
        self.name, self.n, self.experts = name, n, len(experts)
        self.max_rows = int(counts.max())
        self.starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(DEVICE)
        self.rows = (torch.argsort(inverse, stable=True) // 8).to(DEVICE)  # the token of each sorted pair
        self.bounds = list(zip(self.starts[:-1].tolist(), self.starts[1:].tolist()))
        self.nbytes = TYPES[name].nbytes(n, k)
        self.slot = (self.nbytes + 255) // 256 * 256
        self.copies = max(2, -(-pool_bytes // (self.slot * self.experts)))
        self.buf = torch.empty(self.copies * self.experts * self.slot, dtype=torch.uint8, device=DEVICE)
        one = random_blocks(name, n, k, gen)
        for s in range(self.copies * self.experts):
            self.buf[s * self.slot : s * self.slot + self.nbytes] = one
        slots = torch.arange(self.experts, dtype=torch.int64, device=DEVICE) * self.slot
        self.offsets = [slots + c * self.experts * self.slot for c in range(self.copies)]
        self.x = torch.randn(tokens, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        self.gathered = self.x[self.rows]
        dense = torch.randn(self.experts, n, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        self.dense = pool_of(dense, pool_bytes)

    def grouped(self, i: int) -> None:
        offsets = self.offsets[i % self.copies]
        kernels.grouped_matmul(
            self.x, self.buf, self.name, self.n, offsets, self.starts, rows=self.rows, max_rows=self.max_rows
        )

    def per_expert(self, i: int) -> None:
        base = (i % self.copies) * self.experts * self.slot
        for e, (a, b) in enumerate(self.bounds):
            at = base + e * self.slot
            kernels.matmul(self.gathered[a:b], self.buf[at : at + self.nbytes], self.name, self.n)

    def bf16(self, i: int) -> None:
        dense = self.dense[i % len(self.dense)]
        for e, (a, b) in enumerate(self.bounds):
            torch.nn.functional.linear(self.gathered[a:b], dense[e])


def bench_layer(args, gen) -> list[dict]:
    """Fused gate+up (Q4_K [1536, 2048]) and down (Q6_K [2048, 768]) of a layer's routed experts: one
    grouped launch per kind against one launch per expert and bf16 F.linear per expert."""
    out = []
    for tokens in args.layer_tokens:
        for name, (n, k) in LAYER_SHAPES.items():
            layer = _Layer(name, n, k, tokens, args.pool_mib << 20, gen)
            cands = {"grouped": layer.grouped, "per expert": layer.per_expert, "bf16": layer.bf16}
            times = time_rounds(cands, args.iters, args.rounds)
            row = {"tokens": tokens, "type": name, "experts": layer.experts}
            out.append(row | {c: t for c, (t, _) in times.items()})
            del layer
    return out


TUNE_TILES = [
    KernelConfig(1, 2, 512, False),
    KernelConfig(1, 4, 512, False),
    KernelConfig(1, 4, 256, False),
    KernelConfig(1, 8, 256, False),
    KernelConfig(1, 16, 256, False),
    KernelConfig(1, 4, 512, False, num_warps=2),
    KernelConfig(4, 4, 256, False),
    KernelConfig(4, 8, 128, False),
    KernelConfig(8, 4, 128, False),
    KernelConfig(16, 32, 64, True),
    KernelConfig(16, 64, 64, True),
]


def _tile_name(c: KernelConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k}{' dot' if c.dot else ''} w{c.num_warps}"


def tune(types: tuple[str, ...], args, gen) -> list[dict]:
    """The direct kernel's time per tile shape at M = 1, 4, 16 (the tiles that fit each M)."""
    out = []
    for name in types:
        for label, (n, k) in SHAPES.items():
            if k % TYPES[name].block:
                continue
            pool = pool_of(random_blocks(name, n, k, gen), args.pool_mib << 20)
            for m in (1, 4, 16):
                x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
                fits = [c for c in TUNE_TILES if c.dot == (m > 8) and (c.dot or c.block_m >= m)]
                cands = {_tile_name(c): _tiled(x, pool, name, n, c) for c in fits}
                times = {c: t for c, (t, _) in time_rounds(cands, args.iters, args.rounds).items()}
                default = _tile_name(kernels.default_config(m, n, k, x.dtype))
                out.append({"type": name, "shape": label, "m": m, "default": default, "all": times})
    return out


def _tiled(x, pool, name, n, cfg) -> Callable[[int], object]:
    return lambda i: kernels.matmul(x, pool[i % len(pool)], name, n, config=cfg)


def dequant_from(rows: list[dict], ms: tuple[int, ...]) -> dict[str, int]:
    """Per type: the smallest measured M from which dequantize + matmul beats the direct kernel at
    every larger measured M, summed over the type's shapes (a whole expert); NEVER if it never does."""
    table = {}
    for name in dict.fromkeys(r["type"] for r in rows):
        start = NEVER
        for m in sorted(ms, reverse=True):
            cells = [r for r in rows if r["type"] == name and r["m"] == m]
            if sum(r["dequant"] for r in cells) >= sum(r["direct"] for r in cells):
                break
            start = m
        table[name] = start
    return table


def _f(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _md(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def print_tables(rows: list[dict], layer: list[dict], tuned: list[dict], ms: tuple[int, ...]) -> None:
    head = ["type", "shape", "M", "direct us", "dequant+mm us", "bf16 us", "tinygemm us", "direct/bf16"]
    head += ["faster route", "host us/call (direct)", "routes' rel. diff"]
    print("\n" + _md(head) + "\n" + _md(["---"] * len(head)))
    for r in rows:
        route = "direct" if r["direct"] <= r["dequant"] else "dequant"
        cells = [r["type"], r["shape"], r["m"], _f(r["direct"]), _f(r["dequant"]), _f(r["bf16"])]
        cells += [_f(r.get("tinygemm")), f"{r['direct'] / r['bf16']:.2f}", route, _f(r["host_direct"])]
        print(_md([*cells, f"{r['rel']:.1e}"]))
    if layer:
        head = ["Qwen3-30B-A3B layer, top-8", "tokens", "experts", "one grouped launch us"]
        head += ["one launch per expert us", "bf16 F.linear per expert us"]
        print("\n" + _md(head) + "\n" + _md(["---"] * len(head)))
        for r in layer:
            kind = "gate+up Q4_K 1536x2048" if r["type"] == "Q4_K" else "down Q6_K 2048x768"
            cells = [kind, r["tokens"], r["experts"], _f(r["grouped"]), _f(r["per expert"]), _f(r["bf16"])]
            print(_md(cells))
    if tuned:
        print("\n" + _md(["type", "shape", "M", "default tile", "tiles, fastest first (us)"]))
        print(_md(["---"] * 5))
        for r in tuned:
            ranked = ", ".join(f"{c}: {t:.1f}" for c, t in sorted(r["all"].items(), key=lambda kv: kv[1]))
            print(_md([r["type"], r["shape"], r["m"], r["default"], ranked]))
    _print_choice(dequant_from(rows, ms), ms)


def _print_choice(table: dict[str, int], ms: tuple[int, ...]) -> None:
    import triton

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"\n# measured by benchmarks/cuda_kernels.py on {_device_name()} (torch "
        f"{torch.__version__}, triton {triton.__version__}), {when}; M measured: {', '.join(map(str, ms))}"
        "\nDEQUANT_FROM = {"
    )
    for name, start in table.items():
        print(f'    "{name}": {"NEVER" if start == NEVER else start},')
    print("}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Q4_K Q6_K MXFP4 Q8_0 at M = 1, 16, 256, 3 rounds")
    ap.add_argument("--types", default=None, help=f"comma-separated (default {','.join(DEFAULT_TYPES)})")
    ap.add_argument("--m", default=None, help="comma-separated rows per matrix (default 1,4,16,64,256)")
    ap.add_argument("--pool-mib", type=int, default=320, help="weights rotate through more than this")
    ap.add_argument("--iters", type=int, default=100, help="calls per timed loop")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (the median is reported)")
    ap.add_argument("--tune", action="store_true", help="also time tile shapes of the direct kernel")
    ap.add_argument("--no-layer", action="store_true", help="skip the grouped-launch layer benchmark")
    ap.add_argument("--json", default=None, help="also write every figure to this file")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes: no timing")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 3)
    quick_types = ("Q4_K", "Q6_K", "MXFP4", "Q8_0")
    args.types = tuple(args.types.split(",")) if args.types else quick_types if args.quick else DEFAULT_TYPES
    args.m = tuple(int(v) for v in args.m.split(",")) if args.m else (1, 16, 256) if args.quick else ALL_M
    args.layer_tokens, args.tune_types = (1, 16), ("Q4_K", "Q6_K", "MXFP4")
    return args


def _smoke(args: argparse.Namespace) -> None:
    """Shrink everything so the Triton interpreter runs the whole script in a minute (no GPU)."""
    global DEVICE
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke needs TRITON_INTERPRET=1 in the environment")
    DEVICE = "cpu"
    SHAPES.update({"gate/up 768x2048": (8, 512), "down 2048x768": (16, 256), "gpt-oss 2880x2880": (8, 288)})
    LAYER_SHAPES.update({"Q4_K": (8, 512), "Q6_K": (16, 256)})
    args.pool_mib, args.iters, args.rounds = 1, 2, 1
    args.types, args.m, args.layer_tokens, args.tune_types = ("Q4_K", "MXFP4"), (1, 16), (1,), ("Q4_K",)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.smoke:
        _smoke(args)
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks/cuda_kernels.py needs a CUDA GPU (or --smoke)")
    import triton

    t0 = time.perf_counter()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    print(
        f"{_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"pool > {args.pool_mib} MiB | {args.iters} calls x {args.rounds} rounds"
    )
    rows = []
    for name in args.types:
        for label, (_, k) in SHAPES.items():
            if k % TYPES[name].block == 0:
                rows += bench_shape(name, label, args.m, args, gen)
        print(f"  {name} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    layer = [] if args.no_layer else bench_layer(args, gen)
    tuned = tune(args.tune_types, args, gen) if args.tune else []
    print_tables(rows, layer, tuned, args.m)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "layer": layer, "tune": tuned}, indent=1))


if __name__ == "__main__":
    main()

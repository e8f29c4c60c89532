"""Python's share of a decoded token on the ggml runner (issue 31): the wall time of a decode step
outside `Net.run` (the graph's compute and, on a backend, its copies), every expert cached.

On a machine without a GPU, ggml's CPU backend stands in for the device (`--backend cpu`: the same
path as ggml's CUDA backend, MOESTREAM_GGML_BACKEND=cpu: one graph a step over expert stacks, inputs
uploaded and outputs downloaded around it); `--backend host` runs the CPU graphs in place (the path CPU
users run). Use a tiny synthetic GGUF, so that the graph's compute is small beside the Python:

    python -m moestream synth /tmp/tiny.gguf --arch qwen3_moe --layers 24 --experts 16 --top-k 8 \
        --hidden 256 --moe-intermediate 256
    python benchmarks/decode_overhead.py /tmp/tiny.gguf --backend cpu --tokens 64 --repeats 7 \
        [--skip-compute] [--profile]

Per decoded token: the wall time (first sampled token to last), the time inside Net.run, and the rest
(Python: the token loop, sampling, the runner's step, the shard check, stats); medians of `--repeats`
generations after `--warmup` ones. `--skip-compute`: Net.run a no-op in the measured decodes (their
prefill too: the tokens are then meaningless), so that the CPU's compute does not flush the caches the
Python runs from, as a GPU's compute does not: the Python's own time, the steadiest figure here.
`--profile`: a cProfile of one more generation's decode, the functions by their own time in us per
decoded token (Net.run's compute shown apart). `--gpu-tier SIZE --tier-misses WAY`: the device path over
a GPU tier of that size (a graph a layer; on `--backend cpu` only), e.g. a quarter of a 24 x 128-expert
tiny synthetic's experts with the way "host". Prints one JSON line per backend.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moestream
from moestream.ggml.net import Net

_INSIDE = [0.0]
_RUN = Net.run


def _timed(self: Net) -> None:
    t0 = time.perf_counter()
    _RUN(self)
    _INSIDE[0] += time.perf_counter() - t0


def _skipped(self: Net) -> None:
    """`--skip-compute`: the step's graph not run (nor, on a backend, its copies)."""


def decode(engine: moestream.Engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(seconds, seconds inside Net.run) of a generation's decode steps, per decoded token."""
    t0 = inside = 0.0
    n = 0
    for n, _ in enumerate(engine.stream(prompt, max_tokens=tokens, ignore_eos=True)):
        if n == 0:  # the first token is sampled: the prefill is done
            t0, inside = time.perf_counter(), _INSIDE[0]
    wall = time.perf_counter() - t0
    return wall / n, (_INSIDE[0] - inside) / n


def profile(engine: moestream.Engine, prompt: list[int], tokens: int, top: int) -> str:
    """cProfile of one generation's decode (the profiler on from the first token sampled): the `top`
    functions by own time, in microseconds per decoded token (cProfile's own cost included)."""
    prof = cProfile.Profile()
    n = 0
    for n, _ in enumerate(engine.stream(prompt, max_tokens=tokens, ignore_eos=True)):
        if n == 0:
            prof.enable()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO()).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])
    lines = [f"{'own us':>8} {'cum us':>8} {'calls':>6}  function (per decoded token, {n} tokens)"]
    for (file, line, name), (_, calls, own, cum, _) in rows[:top]:
        where = f"{Path(file).name}:{line}({name})" if line else name
        lines.append(f"{own / n * 1e6:8.1f} {cum / n * 1e6:8.1f} {calls / n:6.1f}  {where}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--backend", default="cpu", help="cpu (the device path), host (CPU graphs), or both")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated a run")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--skip-compute",
        action="store_true",
        help="decode steps' Net.run a no-op (after a normal prefill): the Python alone, its caches not "
        "flushed by the CPU's compute (as a GPU's compute leaves them); the tokens are then meaningless",
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument("--gpu-tier", default="", help="a GPU tier of this size on the backend (e.g. 40MiB)")
    p.add_argument("--tier-misses", default="host", help="the tier's way of a miss: upload, host or split")
    p.add_argument("--top", type=int, default=30, help="profile rows")
    args = p.parse_args()
    Net.run = _timed
    for backend in ["cpu", "host"] if args.backend == "both" else [args.backend]:
        if backend == "host":
            os.environ.pop("MOESTREAM_GGML_BACKEND", None)
        else:
            os.environ["MOESTREAM_GGML_BACKEND"] = backend
        tier = {"gpu_tier": args.gpu_tier} if args.gpu_tier and backend != "host" else {}
        if tier:
            os.environ["MOESTREAM_TIER_MISSES"] = args.tier_misses
        else:
            os.environ.pop("MOESTREAM_TIER_MISSES", None)
        with moestream.load(args.model, trunk="ggml", threads=args.threads, **tier) as engine:
            print(engine.mode_line(), file=sys.stderr, flush=True)
            prompt = [100 + i for i in range(args.prompt)]
            for _ in range(args.warmup):
                decode(engine, prompt, args.tokens)
            if args.skip_compute:
                Net.run = _skipped
            runs = [decode(engine, prompt, args.tokens) for _ in range(args.repeats)]
            wall = statistics.median(w for w, _ in runs)
            graph = statistics.median(g for _, g in runs)
            rest = statistics.median(w - g for w, g in runs)
            row = {
                "backend": backend,
                "compute": "skipped" if args.skip_compute else "run",
                "wall_us": round(wall * 1e6, 1),
                "net_run_us": round(graph * 1e6, 1),
                "python_us": round(rest * 1e6, 1),
                "python_runs_us": sorted(round((w - g) * 1e6, 1) for w, g in runs),
            }
            print(json.dumps(row), flush=True)
            if args.profile:
                print(profile(engine, prompt, args.tokens, args.top), flush=True)
            Net.run = _timed


if __name__ == "__main__":
    main()

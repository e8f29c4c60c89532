"""Where decode time goes when it is miss-bound: a timeline of the disk and the compute thread.

Instruments one engine (no code of moestream changes): every piece the I/O threads read (start, end),
and per MoE layer forward the moments it entered, had the routing back, had queued its reads, and
returned. Over the decode steps (one token per forward) it reports the share of wall time during which
at least one read was in flight, the mean number of reads in flight, and, for each gap during which
the disk idled, which phase of the compute thread it fell in. With --profile, a cProfile of the
generation (top functions by own time); on Python 3.12 and later it also sees the I/O threads and slows
them, so take the timeline's figures from a run without it.

    python benchmarks/timeline.py CHECKPOINT [engine options as `moestream generate`] --tokens 8 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import itertools

import moestream
from moestream.cache import records
from moestream.cli._engine_args import add_engine_arguments, engine_kwargs
from moestream.io import reader as reader_mod
from moestream.runtime import experts as experts_mod

PROMPT = "The history of the printing press shows how a new machine can change the way people"


class Timeline:
    def __init__(self) -> None:
        self.pieces: list[tuple[float, float, int]] = []  # (start, end, bytes)
        self.layers: list[dict] = []  # one per decode-step layer forward
        self.lock = threading.Lock()
        self.current: dict | None = None

    def install(self) -> None:
        tl = self
        read = reader_mod.Reader._read

        def timed_read(self, request, offset):
            start = time.perf_counter()
            got = read(self, request, offset)
            end = time.perf_counter()
            with tl.lock:
                tl.pieces.append((start, end, got))
            return got

        reader_mod.Reader._read = timed_read

        forward = experts_mod.ExpertRuntime.forward

        def timed_forward(self, layer, hidden, top_k_index, top_k_weights):
            if hidden.shape[0] != 1:
                tl.current = None
                return forward(self, layer, hidden, top_k_index, top_k_weights)
            tl.current = {"layer": layer, "enter": time.perf_counter()}
            out = forward(self, layer, hidden, top_k_index, top_k_weights)
            tl.current["exit"] = time.perf_counter()
            tl.layers.append(tl.current)
            tl.current = None
            return out

        experts_mod.ExpertRuntime.forward = timed_forward

        readback = experts_mod.ExpertRuntime._readback

        def timed_readback(self, *args):
            out = readback(self, *args)
            if tl.current is not None:
                tl.current["routed"] = time.perf_counter()
            return out

        experts_mod.ExpertRuntime._readback = timed_readback

        init = records.LayerJob.__init__

        def timed_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if tl.current is not None:
                tl.current["queued"] = time.perf_counter()

        records.LayerJob.__init__ = timed_init

    def report(self) -> dict:
        layers = self.layers
        t0, t1 = layers[0]["enter"], layers[-1]["exit"]
        pieces = sorted(p for p in self.pieces if p[1] > t0 and p[0] < t1)
        events = sorted([(max(s, t0), 1) for s, _, _ in pieces] + [(min(e, t1), -1) for _, e, _ in pieces])
        busy, depth_area, depth, last = 0.0, 0.0, 0, t0
        idle: list[tuple[float, float]] = []
        for t, d in events:
            if depth > 0:
                busy += t - last
            elif t > last:
                idle.append((last, t))
            depth_area += depth * (t - last)
            depth += d
            last = t
        if t1 > last:
            idle.append((last, t1))
        wall = t1 - t0
        # attribute idle time to the compute thread's phase
        phases = {
            "in expert compute after its reads": 0.0,
            "between layers (attention, router, norms)": 0.0,
            "routing readback": 0.0,
            "building and queueing reads": 0.0,
            "queued, first read not started": 0.0,
        }
        marks = []
        for i, lay in enumerate(layers):
            if i:
                marks.append(
                    (layers[i - 1]["exit"], lay["enter"], "between layers (attention, router, norms)")
                )
            marks.append((lay["enter"], lay.get("routed", lay["enter"]), "routing readback"))
            routed = lay.get("routed", lay["enter"])
            queued = lay.get("queued", routed)
            marks.append((routed, queued, "building and queueing reads"))
            marks.append((queued, lay["exit"], "in expert compute after its reads"))
        for a, b in idle:
            for s, e, name in marks:
                overlap = min(b, e) - max(a, s)
                if overlap > 0:
                    phases[name] += overlap
        read_bytes = sum(n for s, e, n in pieces if s >= t0 and e <= t1)
        steps = len(layers) / max(1, len({lay["layer"] for lay in layers}))
        return {
            "decode_steps": steps,
            "wall_s": wall,
            "ms_per_token": 1e3 * wall / steps,
            "disk_busy_share": busy / wall,
            "mean_reads_in_flight": depth_area / wall,
            "mean_reads_in_flight_while_busy": depth_area / busy if busy else 0.0,
            "read_GiB_s": read_bytes / wall / 2**30,
            "idle_ms_per_token": {k: 1e3 * v / steps for k, v in phases.items()},
            "layer_ms_mean": {
                "readback": 1e3
                * sum(lay.get("routed", lay["enter"]) - lay["enter"] for lay in layers)
                / len(layers),
                "queue": 1e3
                * sum(
                    lay.get("queued", lay.get("routed", 0)) - lay.get("routed", 0)
                    for lay in layers
                    if "queued" in lay
                )
                / len(layers),
                "whole": 1e3 * sum(lay["exit"] - lay["enter"] for lay in layers) / len(layers),
                "between": 1e3
                * sum(b["enter"] - a["exit"] for a, b in itertools.pairwise(layers))
                / max(1, len(layers) - 1),
            },
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the generation (slows the I/O threads on Python >= 3.12)",
    )
    parser.add_argument("--label", default="")
    add_engine_arguments(parser)
    args = parser.parse_args()
    timeline = Timeline()
    timeline.install()
    with moestream.load(args.path, **engine_kwargs(args)) as engine:
        mode = engine.mode_line()
        engine.generate(args.prompt, max_tokens=2, ignore_eos=True)  # warm-up: kernels, allocator
        timeline.pieces.clear()
        timeline.layers.clear()
        profiler = cProfile.Profile() if args.profile else None
        if profiler:
            profiler.enable()
        out = engine.generate(args.prompt, max_tokens=args.tokens, ignore_eos=True)
        if profiler:
            profiler.disable()
    result = {
        "label": args.label,
        "mode": mode,
        "decode_tok_s": out.stats.to_dict().get("decode_tok_s"),
        **timeline.report(),
    }
    print(json.dumps(result, indent=1))
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

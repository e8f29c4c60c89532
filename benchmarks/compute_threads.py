"""Whether the thread that computes matters (an OpenMP build of ggml: llama.cpp's default, e.g. the
prebuilt CPU library of ../shared/h200): the ggml runner's decode loop and `Engine.generate`, each from
the main thread (which computed the load's graphs) and from another thread, on one model.

    CUDA_VISIBLE_DEVICES= MOESTREAM_GGML_LIB=/tmp/llama.cpp-cuda-sm90 \\
        python3 benchmarks/compute_threads.py MODEL.gguf THREADS [PARALLEL]

Prints tok/s: "runner main thread" (two runs of 48 decode steps), "runner other thread", "engine main
thread" and "engine other thread" (64 greedy tokens, the stats line). With ggml's own pool (the wheel,
`make native`) the four agree; before f168dca an OpenMP build ran the other thread's at half the rate
(BENCHMARKS.md, issue 33 on 16 cores).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moestream

PROMPT = "def read_config(path):"


def runner_loop(engine, tokens: int = 48) -> float:
    """The runner's decode steps alone in slot 0, each fed its argmax: tok/s."""
    runner = engine.runner
    kv = runner.seqs[0]
    kv.tokens = 0
    with torch.inference_mode():
        row = int(runner(engine.encode(PROMPT), kv)[0].argmax())
        start = time.perf_counter()
        for _ in range(tokens):
            row = int(runner.decode([(kv, row)])[0].argmax())
        return tokens / (time.perf_counter() - start)


def on_thread(fn):
    """fn() on a new thread: its result."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    parallel = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    with moestream.load(path, threads=threads, parallel=parallel) as engine:
        print(engine.runner.describe(), flush=True)
        print("runner main thread", round(runner_loop(engine), 1), round(runner_loop(engine), 1), flush=True)
        print("runner other thread", [round(on_thread(lambda: runner_loop(engine)), 1) for _ in range(2)])
        engine.generate(PROMPT, max_tokens=8, ignore_eos=True)
        gen = engine.generate(PROMPT, max_tokens=64, ignore_eos=True)
        print("engine main thread", gen.stats.line(), flush=True)
        gen = on_thread(lambda: engine.generate(PROMPT, max_tokens=64, ignore_eos=True))
        print("engine other thread", gen.stats.line(), flush=True)


if __name__ == "__main__":
    main()

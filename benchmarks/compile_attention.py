"""A probe of the fixed cost per token: decode with each decoder layer's attention under torch.compile
(dynamic shapes, transformers' own DynamicCache; one compile per layer) against eager, on one loaded
engine (every expert cached, 1 thread).

    python benchmarks/compile_attention.py CHECKPOINT eager|compile
"""

from __future__ import annotations

import sys
import time

import torch

import moestream


def main() -> None:
    mode = sys.argv[2]
    torch._dynamo.config.recompile_limit = 64  # one compile per layer (each has its own layer index)
    with moestream.load(sys.argv[1], cache="256MiB", threads=1, ctx_size=512) as engine:
        if mode == "compile":
            for layer in engine.model.model.layers:
                layer.self_attn.forward = torch.compile(layer.self_attn.forward, dynamic=True)
        ids = engine.encode("def read_config(path):")
        start = time.perf_counter()
        engine.generate(ids, max_tokens=32, ignore_eos=True)  # compiles, when asked
        print("warm-up s", round(time.perf_counter() - start, 1))
        out = engine.generate(ids, max_tokens=128, ignore_eos=True)
        print(mode, out.stats.line())


if __name__ == "__main__":
    main()

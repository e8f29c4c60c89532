"""A probe of the fixed cost per token: decode with each decoder layer's attention under torch.compile
against eager, on one loaded engine (every expert cached, 1 thread).

- `compile`: dynamic shapes over transformers' own DynamicCache (one compile per layer);
- `compile-static`: static shapes over moestream's static KV cache (`--trunk static`), one-token steps
  only (prefill stays eager, so a new prompt length compiles nothing).

    python benchmarks/compile_attention.py CHECKPOINT eager|compile|compile-static [eager|static]
"""

from __future__ import annotations

import sys
import time

import torch

import moestream


def _decode_only(eager, compiled):
    def forward(hidden_states, *args, **kwargs):
        return (compiled if hidden_states.shape[1] == 1 else eager)(hidden_states, *args, **kwargs)

    return forward


def main() -> None:
    mode = sys.argv[2]
    trunk = sys.argv[3] if len(sys.argv) > 3 else ("static" if mode == "compile-static" else "eager")
    torch._dynamo.config.recompile_limit = 64  # one compile per layer (each has its own layer index)
    with moestream.load(sys.argv[1], cache="256MiB", threads=1, ctx_size=512, trunk=trunk) as engine:
        for layer in engine.model.model.layers if mode != "eager" else []:
            eager = layer.self_attn.forward
            if mode == "compile":
                layer.self_attn.forward = torch.compile(eager, dynamic=True)
            else:
                layer.self_attn.forward = _decode_only(eager, torch.compile(eager, dynamic=False))
        ids = engine.encode("def read_config(path):")
        start = time.perf_counter()
        engine.generate(ids, max_tokens=32, ignore_eos=True)  # compiles, when asked
        print("warm-up s", round(time.perf_counter() - start, 1))
        for _ in range(2):
            out = engine.generate(ids, max_tokens=128, ignore_eos=True)
            print(mode, f"trunk {trunk}", out.stats.line())


if __name__ == "__main__":
    main()

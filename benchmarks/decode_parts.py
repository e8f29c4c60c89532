"""Where a decoded token's time goes with every expert cached (compute only): ms per token by module.

Wraps modules of one loaded engine with timers (routed experts = `ExpertRuntime.forward`, the MoE block,
attention and its four projections, the router, norms, the LM head), warms the cache with two
generations, then times an N+1-token generation and subtracts a 1-token one (its prefill).

    python benchmarks/decode_parts.py CHECKPOINT --cache 9GiB --threads 1 [--tokens 32]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moestream
from moestream.runtime.experts import ExpertRuntime

PROMPT = "Write a detailed overview of how railways changed trade and travel in the nineteenth century."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--cache", default="9GiB", help="large enough for every expert")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    spent: dict[str, float] = collections.defaultdict(float)

    def wrap(obj: object, name: str, label: str) -> None:
        original = getattr(obj, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent[label] += time.perf_counter() - start

        setattr(obj, name, timed)

    wrap(ExpertRuntime, "forward", "routed experts")
    with moestream.load(args.checkpoint, cache=args.cache, threads=args.threads, ctx_size=512) as engine:
        print(engine.mode_line())
        model = engine.model
        for layer in model.model.layers:
            wrap(layer.self_attn, "forward", "attention")
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                wrap(getattr(layer.self_attn, proj), "forward", "attention projections")
            wrap(layer.mlp, "forward", "MoE block (router + experts)")
            wrap(layer.mlp.gate, "forward", "router")
            wrap(layer.input_layernorm, "forward", "norms")
            wrap(layer.post_attention_layernorm, "forward", "norms")
        wrap(model.lm_head, "forward", "lm head")
        ids = engine.encode(PROMPT)
        engine.generate(ids, max_tokens=48, ignore_eos=True)  # reads the experts it routes to
        engine.generate(ids, max_tokens=8, ignore_eos=True)
        spent.clear()
        start = time.perf_counter()
        gen = engine.generate(ids, max_tokens=args.tokens + 1, ignore_eos=True)
        whole, parts = time.perf_counter() - start, dict(spent)
        spent.clear()
        start = time.perf_counter()
        engine.generate(ids, max_tokens=1, ignore_eos=True)
        prefill = time.perf_counter() - start
        print(gen.stats.line())
        for label, seconds in parts.items():
            print(f"{label:30s} {(seconds - spent.get(label, 0.0)) / args.tokens * 1e3:7.2f} ms/token")
        print(f"{'whole decode step':30s} {(whole - prefill) / args.tokens * 1e3:7.2f} ms/token")


if __name__ == "__main__":
    main()

"""Where a decoded token's time goes with every expert cached (compute only): ms per token by module.

Wraps modules of one loaded engine with timers (routed experts = `ExpertRuntime.forward`, the MoE block,
attention and its four projections, the router, norms, the LM head), warms the cache with two
generations, then times an N+1-token generation and subtracts a 1-token one (its prefill).

On CUDA (`--device cuda --gpu-cache SIZE`) a module's time is the host's time enqueueing its work (the
GPU runs behind; a decode step waits for it once, at the routing readback of each layer), unless
`--sync` waits for the GPU around each timed module (adds a synchronisation per module). `--per-expert`
computes cached experts one by one (never as one batch: the comparison point).

    python benchmarks/decode_parts.py CHECKPOINT --cache 9GiB --threads 1 [--tokens 32]
    python benchmarks/decode_parts.py CHECKPOINT --device cuda --gpu-cache 20GiB [--sync] [--per-expert]
        [--trunk graphs]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import moestream
from moestream.engine.options import TRUNK_MODES
from moestream.runtime.experts import ExpertRuntime

PROMPT = "Write a detailed overview of how railways changed trade and travel in the nineteenth century."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--cache", default="9GiB", help="large enough for every expert")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--gpu-cache", default=None, help="CUDA: GPU expert slots (default: --cache)")
    p.add_argument("--sync", action="store_true", help="CUDA: wait for the GPU around each timed module")
    p.add_argument("--per-expert", action="store_true", help="held experts one by one, never as one batch")
    p.add_argument(
        "--trunk",
        default="eager",
        choices=TRUNK_MODES,
        help="eager (default: every module's own time), or another --trunk mode (with CUDA graphs the "
        "trunk's modules run inside the graphs, so only the routed experts and the whole step are timed)",
    )
    args = p.parse_args()
    sync = torch.cuda.synchronize if args.sync and args.device == "cuda" else (lambda: None)
    spent: dict[str, float] = collections.defaultdict(float)

    def wrap(obj: object, name: str, label: str) -> None:
        original = getattr(obj, name)

        def timed(*a, **k):
            sync()
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                sync()
                spent[label] += time.perf_counter() - start

        setattr(obj, name, timed)

    wrap(ExpertRuntime, "forward", "routed experts")
    opts = {"device": args.device, "gpu_cache": args.gpu_cache} if args.device != "cpu" else {}
    with moestream.load(
        args.checkpoint, cache=args.cache, threads=args.threads, ctx_size=512, trunk=args.trunk, **opts
    ) as engine:
        print(engine.mode_line())
        if args.per_expert:
            for plan in engine.runtime.plans.values():
                plan.batched = False
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
        calls = engine.runtime.layer_calls
        start = time.perf_counter()
        gen = engine.generate(ids, max_tokens=args.tokens + 1, ignore_eos=True)
        whole, parts = time.perf_counter() - start, dict(spent)
        spent.clear()
        start = time.perf_counter()
        engine.generate(ids, max_tokens=1, ignore_eos=True)
        prefill = time.perf_counter() - start
        print(gen.stats.line())
        print(f"layer forwards computed as one batch: {engine.runtime.layer_calls - calls}")
        for label, seconds in parts.items():
            print(f"{label:30s} {(seconds - spent.get(label, 0.0)) / args.tokens * 1e3:7.2f} ms/token")
        print(f"{'whole decode step':30s} {(whole - prefill) / args.tokens * 1e3:7.2f} ms/token")


if __name__ == "__main__":
    main()

"""Stock transformers decoding a checkpoint's shape with every weight on the GPU: the baseline of
"every expert in the GPU tier" when measuring the fixed cost per token.

The model is built from the checkpoint's config.json on the GPU in bf16 with random weights (the speed of
a decode step does not depend on the values; random routers spread tokens over the experts like the
synthetic checkpoints' do), then greedy-decodes from a fixed prompt with transformers' own `generate`
(eager PyTorch, dynamic KV cache). Decode ms per token = (time of N+1 new tokens - time of 1) / N.
`--experts` picks transformers' experts implementation ("eager": a loop over the routed experts;
"grouped_mm": its default, one grouped GEMM per matrix kind).

    python benchmarks/transformers_gpu.py CHECKPOINT_DIR --tokens 32 --experts eager grouped_mm
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers


def generate(model, ids: torch.Tensor, n: int, sync) -> float:
    """Seconds for n greedy new tokens (prefill included)."""
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    sync()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a directory with config.json (the weights are not read)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--experts", nargs="+", default=["eager", "grouped_mm"])
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    config = transformers.AutoConfig.from_pretrained(args.checkpoint)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), device=dev)
    for impl in args.experts:
        config._experts_implementation = impl
        start = time.perf_counter()
        with dev:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        built = time.perf_counter() - start

        generate(model, ids, 4, sync)  # warm-up: kernels, allocator
        long, short = generate(model, ids, args.tokens + 1, sync), generate(model, ids, 1, sync)
        ms = (long - short) / args.tokens * 1e3
        row = {
            "experts_implementation": model.config._experts_implementation,
            "attn_implementation": model.config._attn_implementation,
            "layers": config.num_hidden_layers,
            "decode_ms_per_token": round(ms, 2),
            "decode_tok_s": round(1e3 / ms, 2),
            "prefill_s": round(short, 3),
            "built_s": round(built, 1),
            "gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev.type == "cuda" else None,
        }
        print(json.dumps(row))
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()

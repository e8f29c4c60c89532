"""Time reading a GGUF header with a real-sized vocabulary: moestream's reader against gguf.GGUFReader.

    .venv/bin/python benchmarks/gguf_header.py [--out /tmp/vocab.gguf]

The file has Qwen3's vocabulary size (151,936 tokens, 151,387 merges) and a few hundred small tensors;
the tensor data does not matter, the header does. Also times the meta-device model build the GGUF
trunk mapping needs (`ExpectedKeys`) for a Qwen3-30B-A3B-shaped config.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gguf
import numpy as np


def _write(out: Path) -> None:
    w = gguf.GGUFWriter(out, "qwen3moe")
    w.add_block_count(48)
    w.add_expert_count(128)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"tok{i}" for i in range(151936)])
    w.add_token_types([1] * 151936)
    w.add_token_merges([f"a{i} b{i}" for i in range(151387)])
    for i in range(244):
        w.add_tensor(f"t{i}", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _expected_keys_s() -> tuple[float, float, int]:
    """(first, second) meta builds of a 48-layer Qwen3-MoE with StreamingExperts, and its key count."""
    import transformers as T
    from transformers.monkey_patching import register_patch_mapping, unregister_patch_mapping

    from moestream.model.loader import ExpectedKeys
    from moestream.model.streaming import StreamingExperts

    cfg = T.Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
    )
    register_patch_mapping({"Qwen3MoeExperts": StreamingExperts}, overwrite=True)
    try:
        first = _best(lambda: len(ExpectedKeys(T.Qwen3MoeForCausalLM, cfg)), 1)
        second = _best(lambda: len(ExpectedKeys(T.Qwen3MoeForCausalLM, cfg)), 3)
        keys = len(ExpectedKeys(T.Qwen3MoeForCausalLM, cfg))
    finally:
        unregister_patch_mapping(["Qwen3MoeExperts"])
    return first, second, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/moestream-vocab.gguf", type=Path)
    args = parser.parse_args()
    if not args.out.exists():
        _write(args.out)
    from moestream.store.gguf_file import read_header

    print(f"moestream read_header (best of 3): {_best(lambda: read_header(args.out), 3) * 1000:.1f} ms")
    print(f"gguf.GGUFReader (once):            {_best(lambda: gguf.GGUFReader(args.out), 1) * 1000:.1f} ms")
    first, second, keys = _expected_keys_s()
    print(f"ExpectedKeys meta build, 48 layers: first {first * 1000:.0f} ms, then {second * 1000:.0f} ms")
    print(f"({keys} keys)")


if __name__ == "__main__":
    main()

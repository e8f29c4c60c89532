"""Qwen3.5's out_proj kept as the GGUF's blocks (its input permuted) against moved to f32 (before):
the trunk's bytes and 1-thread decode tok/s, both engines in one process, runs alternated.

    python benchmarks/qwen35_out_proj.py DIR [--type Q8_0] [--tokens 32] [--runs 8]

Writes (once, under DIR) a synthetic qwen3_5_moe GGUF at Qwen3.5/3.6-35B-A3B's layer shape (hidden 2048,
DeltaNet 16 key / 32 value heads of 128, 16 x 256 attention heads; 4 layers, 3 of them DeltaNet, 8
experts of 512) with tests/tiny_gguf.py's writer, every matrix in --type (types gguf cannot quantize,
Q4_K, as random valid blocks). "before" loads it with out_proj's columns moved back, dequantized to f32.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gguf import GGMLQuantizationType as Q

import moestream
from moestream.model.quantized import block_bytes
from moestream.store import gguf_trunk

PROMPT = [5, 17, 33, 2, 99, 41, 7, 250, 3, 12, 80, 64]


def write(out: Path, qtype: Q) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import tiny_gguf
    from tiny_models import write_tiny

    path = out / f"q35-{qtype.name}.gguf"
    if path.exists():
        return path
    hf = out / "hf"
    if not (hf / "config.json").exists():
        lin, full = "linear_attention", "full_attention"
        rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
        write_tiny(
            "qwen3_5_moe",
            hf,
            hidden_size=2048,
            num_hidden_layers=4,
            layer_types=[lin, lin, lin, full],
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            rope_parameters={**rope, "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        )
    return tiny_gguf.write_gguf(hf, path, ftype=qtype, expert_type=lambda layer, kind: qtype)


def load(path: Path, before: bool) -> moestream.Engine:
    moved = gguf_trunk.Trunk._moved_cols
    if before:  # out_proj's columns moved back, so dequantized to f32
        gguf_trunk.Trunk._moved_cols = lambda self, key, shape: None
    try:
        engine = moestream.load(str(path), cache="1GiB", trunk="ggml", threads=1)
    finally:
        gguf_trunk.Trunk._moved_cols = moved
    out_proj = type(engine.model.model.layers[0].linear_attn.out_proj).__name__
    name = "before" if before else "after"
    blocks = block_bytes(engine.model)
    print(f"{name}: trunk {engine.loaded.trunk.nbytes} B, {blocks} B of it blocks, out_proj {out_proj}")
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--type", default="Q8_0")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=8)
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = write(args.dir, getattr(Q, args.type))
    engines = {"before": load(path, True), "after": load(path, False)}
    for engine in engines.values():  # graphs built, experts read
        engine.generate(PROMPT, max_tokens=8, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for run in range(args.runs):
        for name in ("before", "after") if run % 2 == 0 else ("after", "before"):
            decode = engines[name].generate(PROMPT, max_tokens=args.tokens, ignore_eos=True).stats.decode
            rates[name].append(decode.tokens / decode.seconds)
    for name, values in rates.items():
        median = sorted(values)[len(values) // 2]
        print(f"{name}: decode tok/s {' '.join(f'{v:.1f}' for v in values)}, median {median:.1f}")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()

"""Check `moestream synth --format gguf` against llama.cpp's own pipeline, tensor by tensor.

For the given synth arguments it writes the safetensors synth, converts it with llama.cpp's
`convert_hf_to_gguf.py` (bf16, via convert.py), quantizes that with `llama-quantize` to each file
type, writes `moestream synth --format gguf --quant` of the same arguments, and compares: metadata
keys and values, tensor names, order, types, shapes and bytes. Exit status 1 on any difference other
than `general.name` and moestream's own `moestream.synth` key.

    .venv/bin/python benchmarks/llamacpp/check_synth_gguf.py --llama-cpp LLAMA_CPP_DIR --out /tmp/chk \\
        -- --arch qwen3_moe --layers 8 --experts 16 --top-k 2 --hidden 256 --moe-intermediate 256
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

IGNORED = {"general.name", "moestream.synth"}


def fields(reader: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def compare(theirs: Path, ours: Path, check_order: bool) -> list[str]:
    """Differences between two GGUF files, as lines; empty when they hold the same model."""
    a, b = gguf.GGUFReader(str(theirs)), gguf.GGUFReader(str(ours))
    fa, fb = fields(a), fields(b)
    out = [f"key {k}: only in {theirs.name}" for k in sorted(set(fa) - set(fb) - IGNORED)]
    out += [f"key {k}: only in {ours.name}" for k in sorted(set(fb) - set(fa) - IGNORED)]
    out += [
        f"key {k}: {fa[k]!r:.80} != {fb[k]!r:.80}"
        for k in sorted(set(fa) & set(fb) - IGNORED)
        if fa[k] != fb[k]
    ]
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    if set(ta) != set(tb):
        out.append(f"tensor names differ: {sorted(set(ta) ^ set(tb))[:8]}")
    if check_order and list(ta) != list(tb):
        out.append("tensor order differs")
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            out.append(
                f"{name}: {x.tensor_type.name} {list(x.shape)} != {y.tensor_type.name} {list(y.shape)}"
            )
        elif not np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)):
            out.append(f"{name}: bytes differ ({x.tensor_type.name})")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source dir with build/bin")
    p.add_argument("--out", type=Path, required=True, help="scratch directory")
    p.add_argument("--quants", default="Q4_K_M,Q5_K_M,Q8_0,MXFP4_MOE")
    p.add_argument("synth_args", nargs=argparse.REMAINDER, help="-- then `moestream synth` size arguments")
    args = p.parse_args()
    synth = [a for a in args.synth_args if a != "--"]
    py, here = sys.executable, Path(__file__).parent
    args.out.mkdir(parents=True, exist_ok=True)
    st, bf16 = args.out / "st", args.out / "llama-bf16.gguf"
    run = lambda *cmd: subprocess.run([str(c) for c in cmd], check=True, capture_output=True)  # noqa: E731
    run(py, "-m", "moestream", "synth", st, *synth, "--force")
    run(py, here / "convert.py", st, bf16, "--llama-cpp", args.llama_cpp)
    failed = False
    checks = [("BF16", bf16, False)]
    for q in args.quants.split(","):
        theirs = args.out / f"llama-{q}.gguf"
        run(args.llama_cpp / "build/bin/llama-quantize", bf16, theirs, q, "2")
        checks.append((q, theirs, True))
    for q, theirs, order in checks:
        ours = args.out / f"moestream-{q}.gguf"
        run(py, "-m", "moestream", "synth", ours, *synth, "--format", "gguf", "--quant", q, "--force")
        diffs = compare(theirs, ours, check_order=order)
        n = len(gguf.GGUFReader(str(ours)).tensors)
        print(f"{q}: {'identical' if not diffs else f'{len(diffs)} differences'} ({n} tensors)")
        for line in diffs[:20]:
            print("   ", line)
        failed |= bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

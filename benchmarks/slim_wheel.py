"""A transformers wheel without the model folders moestream's lease scripts never import, so that one call to
the GPU machine can carry the server's wheels and ggml's source beside llama.cpp's build (64 MiB a call).

    python benchmarks/slim_wheel.py .gpu/whl/transformers-*.whl .gpu/whl-slim/

Keeps `transformers/models/` of moestream's families, their tokenizers and what transformers' GGUF
integration and AutoTokenizer import (2.6 of 13.5 MB for 5.24.0); its RECORD lists only the files kept.
Checked on the 2-core VM with the slim wheel first on PYTHONPATH: `moestream synth` writes a GGUF,
`moestream generate` on a GGUF gives the same text as with the whole wheel, `moestream serve` runs. (Its
first version lacked `encoder_decoder`, which AutoTokenizer imports: synth stopped on the GPU machine.)
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path

KEEP = {
    # moestream's families (their configs and modeling modules, the reference model)
    *("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_next"),
    *("qwen3_5_moe", "gpt_oss", "qwen3", "qwen3_5", "qwen2", "mistral", "llama", "glm4"),
    # transformers' auto classes, what AutoTokenizer's module imports, what its GGUF integration imports
    *("auto", "encoder_decoder", "timm_backbone", "timm_wrapper"),
    *("gpt2", "gemma", "llama4", "bart", "bert", "roformer", "t5"),
}


def kept(name: str) -> bool:
    parts = name.split("/")
    return not (len(parts) > 3 and parts[:2] == ["transformers", "models"] and parts[2] not in KEEP)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("dest", type=Path, help="folder for the slim wheel (same file name)")
    args = ap.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    out = args.dest / args.wheel.name
    with (
        zipfile.ZipFile(args.wheel) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst,
    ):
        for info in src.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [row for row in src.read(info).decode().splitlines() if kept(row.split(",")[0])]
                dst.writestr(info, "\n".join(lines) + "\n")
            elif kept(info.filename):
                dst.writestr(info, src.read(info))
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB (from {args.wheel.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()

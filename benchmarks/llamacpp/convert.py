"""Convert a synthetic moestream checkpoint to GGUF, in its own dtype (bf16), with llama.cpp's converter.

llama.cpp's `convert_hf_to_gguf.py` identifies a BPE tokenizer's pre-tokenizer by hashing how it splits a
test string, and refuses hashes it does not know. The synthetic checkpoints' tokenizer is a freshly
trained byte-level BPE whose pre-tokenizer is `ByteLevel(use_regex=True)`, i.e. exactly GPT-2's split
regex, so this script declares it as llama.cpp's `gpt-2` pre-tokenizer and runs the converter unchanged
otherwise. Only synthetic checkpoints are accepted (a real one has a pre-tokenizer llama.cpp knows), and
with `--byte-level-bpe` any checkpoint whose tokenizer is such a freshly trained byte-level BPE with
GPT-2's split (the trained fixture `../shared/fixtures/stdlib-moe-8x64`).

    .venv/bin/python benchmarks/llamacpp/convert.py /var/tmp/msb/q12x64 /var/tmp/llamacpp/q12x64-bf16.gguf \
        --llama-cpp /var/tmp/llamacpp/llama_cpp_python-X/vendor/llama.cpp
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def check_synthetic(checkpoint: Path, byte_level_bpe: bool = False) -> None:
    meta = checkpoint / "moestream_synth.json"
    synthetic = meta.exists() and json.loads(meta.read_text()).get("synthetic")
    if not synthetic and not byte_level_bpe:
        raise SystemExit(
            f"{checkpoint} is not a moestream synthetic checkpoint; use llama.cpp's converter directly"
        )
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise SystemExit(
            f"{checkpoint}: the tokenizer's pre-tokenizer is {pre}, not GPT-2's byte-level split"
        )


def _text_model_class(converter: object) -> type:
    """The converter's base class of text models: `conversion.base.TextModel` since the converter was split
    into a package, `TextModel` or `Model` in the single-file versions before."""
    try:
        from conversion.base import TextModel

        return TextModel
    except ImportError:
        return getattr(converter, "TextModel", None) or converter.Model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("outfile", type=Path)
    p.add_argument(
        "--llama-cpp", type=Path, required=True, help="the llama.cpp source directory (build.sh prints it)"
    )
    p.add_argument(
        "--outtype", default="bf16", help="GGUF tensor type (default bf16, the synthetic checkpoint's)"
    )
    p.add_argument(
        "--byte-level-bpe",
        action="store_true",
        help="also a non-synthetic checkpoint whose tokenizer is a byte-level BPE with GPT-2's split",
    )
    args = p.parse_args()
    check_synthetic(args.checkpoint, args.byte_level_bpe)
    sys.path[:0] = [str(args.llama_cpp / "gguf-py"), str(args.llama_cpp)]  # its own gguf package, not PyPI's
    import convert_hf_to_gguf as converter

    base = _text_model_class(converter)

    def gpt2_pre_tokenizer(self: object, tokenizer: object) -> str:
        return "gpt-2"

    base.get_vocab_base_pre = gpt2_pre_tokenizer
    sys.argv = [
        "convert_hf_to_gguf.py",
        str(args.checkpoint),
        "--outtype",
        args.outtype,
        "--outfile",
        str(args.outfile),
    ]
    converter.main()


if __name__ == "__main__":
    main()

"""The tokenizer a GGUF describes (vocabulary, merges, special tokens, chat template), built by transformers.

`AutoTokenizer.from_pretrained(dir, gguf_file=...)` also rebuilds the model config, which transformers
can only do for a few architectures, so its two underlying steps are called directly: read the
tokenizer metadata, convert it to a `tokenizers` backend of the kind the file names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moestream.errors import UnsupportedModelError


def gguf_tokenizer(path: Path) -> Any:
    """A transformers fast tokenizer with the file's chat template and special tokens.

    Raises:
        UnsupportedModelError: transformers cannot build the tokenizer kind the file names.
    """
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:  # older transformers spell these differently
        raise UnsupportedModelError(
            "building the tokenizer of a GGUF needs transformers >= 5.24 (pip install -U transformers)"
        ) from None

    try:
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except ValueError as exc:
        raise UnsupportedModelError(f"cannot build the tokenizer of {path} ({exc})") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**tokenizer_config, **extra})

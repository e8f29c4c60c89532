"""The tokenizer a GGUF describes (vocabulary, merges, special tokens, chat template), built by transformers.

`AutoTokenizer.from_pretrained(dir, gguf_file=...)` also rebuilds the model config, which transformers
can only do for a few architectures, so its two underlying steps are called directly: read the
tokenizer metadata, convert it to a `tokenizers` backend of the kind the file names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moestream.errors import UnsupportedModelError

# transformers 5.17 builds the tokenizer of Qwen3.5 GGUFs only (convert_gguf_tokenizer elsewhere); 5.18
# builds every kind the supported architectures use
NEEDS = "building the tokenizer of a GGUF needs transformers >= 5.18 (pip install -U 'transformers>=5.18')"


def transformers_builds_gguf_tokenizers() -> bool:
    """Whether the installed transformers has the two functions `gguf_tokenizer` calls (5.18 and later)."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer  # noqa: F401
    except ImportError:
        return False
    return True


def gguf_tokenizer(path: Path) -> Any:
    """A transformers fast tokenizer with the file's chat template and special tokens.

    Raises:
        UnsupportedModelError: transformers cannot build the tokenizer kind the file names, or cannot
            build GGUF tokenizers at all (transformers 5.17).
    """
    from transformers import PreTrainedTokenizerFast

    if not transformers_builds_gguf_tokenizers():
        raise UnsupportedModelError(NEEDS)
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except ValueError as exc:
        raise UnsupportedModelError(f"cannot build the tokenizer of {path} ({exc})") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**tokenizer_config, **extra})

"""Reading transformers configs the same way everywhere (no torch, no model code)."""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The language-model part of a (possibly composite, e.g. vision-language) config."""
    sub = getattr(config, "text_config", None)
    return sub if sub is not None and hasattr(sub, "num_hidden_layers") else config

"""moestream: run Mixture-of-Experts LLMs larger than memory by streaming routed experts from disk."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from moestream.engine.engine import Engine


def load(path: str, **options: Any) -> Engine:
    """Load a HF MoE checkpoint with its routed experts streamed from disk. See `moestream.engine.load`."""
    from moestream.engine.engine import load as _load  # torch is imported only when a model is loaded

    return _load(path, **options)


__all__ = ["__version__", "load"]

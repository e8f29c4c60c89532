"""`moestream synth`: random-weight HF checkpoints of real MoE architectures, and routing measures.

    synthesize(out_dir, arch=..., layers=..., ...) or synthesize(out_dir, preset="qwen3-30b-a3b")
    routing_stats(model, tokenizer, SAMPLE_TEXT)

Imports are lazy so that `import moestream.synth` does not pull in torch or transformers.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ARCHS",
    "PRESETS",
    "SAMPLE_TEXT",
    "SYNTH_MARKER",
    "routing_measures",
    "routing_stats",
    "synthesize",
]

_LAZY = {
    "synthesize": "moestream.synth.build",
    "SYNTH_MARKER": "moestream.synth.build",
    "routing_stats": "moestream.synth.routing",
    "routing_measures": "moestream.synth.routing",
    "SAMPLE_TEXT": "moestream.synth.sample_text",
    "PRESETS": "moestream.synth.shapes",
    "ARCHS": "moestream.synth.shapes",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moestream.synth' has no attribute {name!r}")

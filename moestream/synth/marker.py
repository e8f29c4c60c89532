"""The synth marker (moestream_synth.json, or the GGUF key moestream.synth) and progress counting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import moestream
from moestream.synth.layout import TensorSpec, expert_layout
from moestream.synth.shapes import SynthSpec
from moestream.synth.tokenizer import IM_END
from moestream.synth.weights import InitScheme


def progress_counter(
    total: int, on_progress: Callable[[int, int], None] | None
) -> Callable[[int], None] | None:
    """Turn per-chunk byte counts into on_progress(done, total) calls."""
    if on_progress is None:
        return None
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        on_progress(done, total)

    on_progress(0, total)
    return on_bytes


def synth_marker(
    spec: SynthSpec,
    scheme: InitScheme,
    specs: list[TensorSpec],
    files: list[str],
    vocab: int,
    tokenizer_size: int,
    seconds: float,
) -> dict[str, Any]:
    """Contents of moestream_synth.json: the synth parameters, byte counts and `"synthetic": true`."""
    expert_bytes = sum(s.nbytes for s in specs if s.routed)
    return {
        "synthetic": True,
        "generator": f"moestream synth {moestream.__version__}",
        "preset": spec.preset,
        "arch": spec.arch,
        "layers": spec.layers,
        "experts": spec.experts,
        "top_k": spec.top_k,
        "hidden": spec.hidden,
        "moe_intermediate": spec.moe_intermediate,
        "dtype": spec.dtype,
        "seed": spec.seed,
        "mxfp4": spec.mxfp4,
        "realistic_routing": spec.realistic_routing,
        "init": {"std": scheme.std, "embed_scale": scheme.embed_scale, "out_scale": scheme.out_scale},
        "vocab_size": vocab,
        "tokenizer_size": tokenizer_size,
        "expert_layout": expert_layout(spec.arch, spec.mxfp4),
        "moe_layers": len({s.layer for s in specs if s.routed}),
        "expert_bytes": expert_bytes,
        "total_bytes": sum(s.nbytes for s in specs),
        "files": files,
        "seconds": round(seconds, 3),
        "chat_stop_token": IM_END,
    }

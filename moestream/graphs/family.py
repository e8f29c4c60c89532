"""`GraphFamily`: how one family's layers are read for the ggml graphs, and the registry of families.

A family module (`graphs/qwen3_moe.py`, `graphs/deepseek.py`, ...; like llama.cpp's `src/models/*.cpp`
and mlx-lm's `models/`) makes one `GraphFamily`, overriding the readers where the family differs
(its attention, its router, its norms, the config it refuses), and `register`s it under its
`model_type`. What a layer computes travels with its spec (`Layer.mixer.graph`), so the shared builders
(`graphs/layers.py`) never ask which family they build.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moestream.graphs.attention import read_attention
from moestream.graphs.parts import NoGraph, Router, f32, softmax_router


class GraphFamily:
    """The readers of one family's layers, from the modules transformers built. The defaults read a
    standard decoder layer: GQA attention (biases and QK-norm where the modules have them), a softmax
    router normalised where the config's `norm_topk_prob` says so, plain RMSNorms."""

    name: str = ""
    aliases: tuple[str, ...] = ()  # other model_types read the same way (a GGUF's, a text-only checkpoint's)
    # the config's `layer_types` the graphs compute (None: the family has none to check)
    layer_types: frozenset[str] | None = None
    zero_centred: bool = False  # its RMSNorms scale by 1 + w (in f32, as transformers adds it)

    def check(self, cfg: Any) -> None:
        """Refuse, with the reason, a config whose layers the graphs do not compute.

        Raises:
            NoGraph: an activation, a sliding window or a layer type the graphs lack.
        """
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NoGraph(f"activation {cfg.hidden_act!r} is not in the graphs yet")
        if getattr(cfg, "sliding_window", None) and self.slides(cfg):
            raise NoGraph("sliding-window attention is not in the graphs yet")
        kinds = set(getattr(cfg, "layer_types", None) or ())
        if self.layer_types is not None and not kinds <= self.layer_types:
            raise NoGraph(f"layer types {sorted(kinds)} are not in the graphs yet")

    def slides(self, cfg: Any) -> bool:
        """Whether the config's `sliding_window` is in use (the graphs then refuse it)."""
        return bool(getattr(cfg, "use_sliding_window", False))

    def norm(self, module: nn.Module) -> torch.Tensor:
        """An RMSNorm's factor: its weight, or 1 + weight where the family's norms are zero-centred."""
        w = f32(module.weight)
        return (1.0 + w).contiguous() if self.zero_centred else w

    def attention(self, module: nn.Module, cfg: Any) -> Any:
        """A layer's attention spec (`attention.Attention`, or the family's own kind)."""
        return read_attention(module, cfg, self.norm)

    def router(self, mlp: nn.Module, cfg: Any) -> Router:
        """A MoE layer's router (and shared expert) spec."""
        return softmax_router(mlp.gate, cfg, bool(getattr(cfg, "norm_topk_prob", False)))

    def linear(self, module: nn.Module, cfg: Any) -> Any:
        """A linear-attention layer's spec.

        Raises:
            NoGraph: the family has none in the graphs.
        """
        raise NoGraph(f"{self.name}'s linear-attention layers are not in the graphs")


_FAMILIES: dict[str, GraphFamily] = {}  # model_type -> its family, in the order registered
_NAMES: list[str] = []  # the families' own names, in the order registered


def register(family: GraphFamily) -> GraphFamily:
    """Make `family` the reader of its `name` and `aliases` (once each)."""
    for model_type in (family.name, *family.aliases):
        if model_type in _FAMILIES:
            raise ValueError(f"two graph families for {model_type}")
        _FAMILIES[model_type] = family
    _NAMES.append(family.name)
    return family


def family_for(model_type: str) -> GraphFamily:
    """The family registered for `model_type`.

    Raises:
        NoGraph: none is (the message lists those that are).
    """
    family = _FAMILIES.get(model_type)
    if family is None:
        raise NoGraph(f"{model_type} has no ggml graph yet (graphs: {', '.join(_NAMES)})")
    return family


def family_names() -> tuple[str, ...]:
    """Every registered family's name, in the order registered."""
    return tuple(_NAMES)

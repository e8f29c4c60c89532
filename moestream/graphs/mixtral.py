"""Mixtral: GQA without QK-norm, a softmax router whose top-k probabilities are always normalised
(transformers' Mixtral ignores `norm_topk_prob`), no shared expert. A config's `sliding_window` is in use
whenever it is set (Mistral's rule, no `use_sliding_window`), which the graphs refuse."""

from __future__ import annotations

from typing import Any

from torch import nn

from moestream.graphs.family import GraphFamily, register
from moestream.graphs.parts import Router, softmax_router


class Mixtral(GraphFamily):
    name = "mixtral"

    def slides(self, cfg: Any) -> bool:
        return True

    def router(self, mlp: nn.Module, cfg: Any) -> Router:
        return softmax_router(mlp.gate, cfg, normalize=True)


register(Mixtral())

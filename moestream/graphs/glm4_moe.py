"""GLM-4.5 / GLM-4.6 (glm4_moe): GQA with biases (and a per-head QK-norm where the config asks), a router of
sigmoid scores with a correction bias for the choice only, the chosen scores normalised and times
`routed_scaling_factor`, and an ungated shared expert. Group-limited routing (topk_group < n_group) is
refused: the released checkpoints keep every group."""

from __future__ import annotations

from typing import Any

from torch import nn

from moestream.graphs.family import GraphFamily, register
from moestream.graphs.parts import NoGraph, Router, f32, read_mlp


class Glm4Moe(GraphFamily):
    name = "glm4_moe"

    def router(self, mlp: nn.Module, cfg: Any) -> Router:
        router = super().router(mlp, cfg)
        groups, kept = int(getattr(cfg, "n_group", 1) or 1), int(getattr(cfg, "topk_group", 1) or 1)
        if groups > 1 and kept < groups:
            raise NoGraph("group-limited routing (topk_group < n_group) is not in the graphs yet")
        router.sigmoid = True
        router.bias = f32(mlp.gate.e_score_correction_bias)
        router.scale = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
        router.shared = read_mlp(mlp.shared_experts)
        return router


register(Glm4Moe())

"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): GQA with biases on q, k and v, a softmax router, and a shared
expert beside the routed ones, gated by sigmoid(shared_expert_gate . x)."""

from __future__ import annotations

from typing import Any

from torch import nn

from moestream.graphs.family import GraphFamily, register
from moestream.graphs.parts import Router, read_mlp, router_matrix


class Qwen2Moe(GraphFamily):
    name = "qwen2_moe"

    def router(self, mlp: nn.Module, cfg: Any) -> Router:
        return with_gated_shared_expert(super().router(mlp, cfg), mlp)


def with_gated_shared_expert(router: Router, mlp: nn.Module) -> Router:
    """`router` with the MoE block's shared expert and its sigmoid gate (Qwen2-MoE, Qwen3-Next, Qwen3.5)."""
    router.shared = read_mlp(mlp.shared_expert)
    router.shared_gate = router_matrix(mlp.shared_expert_gate)
    return router


register(Qwen2Moe())

"""Qwen3.5 MoE: Qwen3-Next's layers (`graphs/qwen3_next.py`: Gated DeltaNet layers between gated
full-attention ones, zero-centred norms, a gated shared expert), its DeltaNet projecting q, k, v, z, b
and a apart (read by the same reader), and a router that always normalises its top-k probabilities
(transformers' Qwen3.5 ignores `norm_topk_prob`). A GGUF's and a text-only checkpoint's model_type is
`qwen3_5_moe_text`."""

from __future__ import annotations

from typing import Any

from torch import nn

from moestream.graphs.family import register
from moestream.graphs.parts import Router, softmax_router
from moestream.graphs.qwen2_moe import with_gated_shared_expert
from moestream.graphs.qwen3_next import Qwen3Next


class Qwen35Moe(Qwen3Next):
    name = "qwen3_5_moe"
    aliases = ("qwen3_5_moe_text",)

    def router(self, mlp: nn.Module, cfg: Any) -> Router:
        return with_gated_shared_expert(softmax_router(mlp.gate, cfg, normalize=True), mlp)


register(Qwen35Moe())

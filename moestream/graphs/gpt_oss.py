"""gpt-oss: attention with biases, a learned sink logit per head, and every other layer a sliding window
(`layer_types`); YaRN rope; a router with a bias whose top-k is taken of the logits, the weights a
softmax over the chosen k. Its experts (biases, a clamped SwiGLU) are the expert family's
(`runtime/families.py:GptOss`), computed in the graphs through `ExpertFamily.graph_terms`."""

from __future__ import annotations

from typing import Any

from torch import nn

from moestream.graphs.attention import Attention, read_attention
from moestream.graphs.family import GraphFamily, register
from moestream.graphs.parts import Router, f32, router_matrix


class GptOss(GraphFamily):
    name = "gpt_oss"
    layer_types = frozenset({"sliding_attention", "full_attention"})

    def attention(self, module: nn.Module, cfg: Any) -> Attention:
        return read_attention(module, cfg, self.norm, window=True)

    def router(self, mlp: nn.Module, cfg: Any) -> Router:
        """logits = W x + b, top-k of the logits, softmax over the chosen k."""
        router = mlp.router
        return Router(
            router_matrix(router),
            int(cfg.num_experts_per_tok),
            normalize=False,
            logit_bias=f32(router.bias),
            softmax_top=True,
        )


register(GptOss())

"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with an RMSNorm over each head's queries and keys, a
softmax router whose top-k probabilities are normalised where the config's `norm_topk_prob` says so
(it does), no shared expert. The standard layer: `GraphFamily`'s readers as they are."""

from __future__ import annotations

from moestream.graphs.family import GraphFamily, register


class Qwen3Moe(GraphFamily):
    name = "qwen3_moe"


register(Qwen3Moe())

"""OLMoE: attention with an RMSNorm over the whole query and key projections (not per head: the
`q_norm` weight spans every head, which `read_attention` reads as "full"), a softmax router (top-k
probabilities not normalised: `norm_topk_prob` false), no shared expert."""

from __future__ import annotations

from moestream.graphs.family import GraphFamily, register


class Olmoe(GraphFamily):
    name = "olmoe"


register(Olmoe())

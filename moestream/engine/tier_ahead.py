"""A GPU tier's layer heard on the host (`engine/tiered_steps.py`), for `--prefetch` and `--trace`.

Each MoE layer's routing comes back to the host after its graph anyway; where a trace records it or the
stale-gate prefetch reads ahead from it, the expert runtime hears it as it hears the CPU path's
(`ExpertLayers.heard`: the gate scores its guess for this layer, a trace records the routing and the
next layer's router on this layer's experts' input, and the next layer's confident guesses come back).
Those the tier's device slots hold need nothing from the host; the rest are read into the host cache
(`ExpertLayers.read_ahead`) once this layer's own reads from disk are queued, so that the disk reads the
next layer's likely experts while this layer's misses are copied and computed and the next graph runs.
"""

from __future__ import annotations

import torch

from moestream.engine.gpu_tier import GpuTier
from moestream.runtime.expert_layers import ExpertLayers


class ReadAhead:
    """One MoE layer's read-ahead, run once (calls after the first do nothing): where the layer's reads
    are queued, or handed to the expert runtime as its `queued` where the runtime reads them."""

    def __init__(self, experts: ExpertLayers | None, predicted: tuple[int, list[int]] | None) -> None:
        self.experts, self.predicted = experts, predicted
        self.done = experts is None  # nothing heard: nothing to read ahead, no gate to ask

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.experts.read_ahead(self.predicted)


def heard(
    experts: ExpertLayers,
    tier: GpuTier,
    layer: int,
    hidden: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
) -> ReadAhead:
    """`layer`'s routing (its experts' input hidden [T, H], the router's order [T, K] and weights [T, K],
    on the host) heard where a trace or prefetch wants it; the read-ahead of the next layer's confident
    guesses that the tier lacks."""
    if not experts.host_routing():
        return ReadAhead(None, None)
    predicted = experts.heard(layer, hidden, order, weights)
    if predicted is not None:
        predicted = (predicted[0], tier.missing(*predicted))
    return ReadAhead(experts, predicted)

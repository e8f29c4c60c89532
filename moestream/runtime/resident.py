"""Every routed expert in the GPU tier: a one-token layer's experts computed without the host.

When the GPU slots hold every expert of the model, a one-token layer needs no routing readback: each
expert's slot is known before the router runs. A device table per (layer, kind) maps expert ids to byte
offsets in the slot buffer, the router's top-k ids index it on the device, and the grouped kernels read
the blocks there (`SlotTable`). Nothing in a decode step then returns to the host, so the trunk's CUDA
graphs need no break: engine/trunk_graphs.py captures the whole step as one graph.

Bit for bit the runtime's own one-token batch: the same `SwitchLayer` and grouped launches (each
expert's rows do not depend on its place in the group), then the same weighted sum, expert by expert in
ascending id order, with the same ops (`ExpertRuntime._forward`). The tables follow the tier: whenever an
expert enters or leaves a slot (`GpuSlotTier.version`) they are rebuilt before the next use, and while
the tier misses an expert the per-layer path runs instead.
"""

from __future__ import annotations

from typing import Any

import torch

from moestream.runtime.experts import ExpertRuntime
from moestream.runtime.formats.base import SlotTable


def unavailable(runtime: ExpertRuntime, top_k: int) -> str | None:
    """Why `runtime`'s experts cannot all be computed from device tables, or None."""
    tier = runtime.tier
    if not hasattr(tier, "holds_all"):
        return "the experts' tier is not GPU slots"
    if tier.capacity < len(runtime.emap.units):
        return f"the GPU tier holds {tier.capacity} of {len(runtime.emap.units)} experts"
    if top_k < 2:
        return "one expert per token is never a batch"
    for (layer, _), fmt in runtime.formats.items():
        if not runtime.plans[layer].batched or not fmt.accepts(1):
            return f"layer {layer}'s {fmt.describe()} experts have no grouped kernel for one token"
    return None


class ResidentExperts:
    """The one-token experts of every MoE layer of `runtime`, from the GPU tier through device tables."""

    def __init__(self, runtime: ExpertRuntime, top_k: int) -> None:
        self.runtime, self.top_k = runtime, top_k
        self.tier: Any = runtime.tier
        self.layers = list(runtime.emap.layers)
        self.kinds = {layer: [k for (lay, k) in runtime.formats if lay == layer] for layer in self.layers}
        experts = runtime.emap.num_experts
        device = self.tier.device
        # [E] int64 per (layer, kind): filled in place (the graphs read these very tensors)
        self.tables = {
            (layer, kind): torch.zeros(experts, dtype=torch.int64, device=device)
            for layer in self.layers
            for kind in self.kinds[layer]
        }
        self._row = torch.zeros(1, dtype=torch.int64, device=device)  # the one token's row
        self._version: int | None = None

    @torch.inference_mode()
    def load_all(self, hidden_size: int, dtype: torch.dtype) -> None:
        """Read every expert into the GPU tier: each layer forwards its experts once, top_k a token (the
        schedule's own reads and copies; the outputs are dropped), then the tables are built.

        Raises:
            RuntimeError: an expert is still missing from the tier afterwards.
        """
        experts, k = self.runtime.emap.num_experts, self.top_k
        tokens = -(-experts // k)
        ids = [[(t * k + j) % experts for j in range(k)] for t in range(tokens)]  # distinct in a row
        device = self.tier.device
        index = torch.tensor(ids, dtype=torch.int64, device=device)
        weights = torch.full((tokens, k), 1.0 / k, dtype=dtype, device=device)
        hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)
        for layer in self.layers:
            self.runtime.forward(layer, hidden, index, weights)
        if not self.tier.holds_all():
            raise RuntimeError("the GPU tier did not keep every expert after reading them all")
        self._refresh()

    def _refresh(self) -> None:
        base = self.tier.buffer.data_ptr()
        for (layer, kind), table in self.tables.items():
            offsets = [
                self.tier.raws(layer, e, kind, None)[0].data_ptr() - base for e in range(table.numel())
            ]
            table.copy_(torch.tensor(offsets, dtype=torch.int64))
        self._version = self.tier.version

    def ready(self) -> bool:
        """Whether the tables describe the tier now and nothing needs the routing on the host (observers,
        a routing replay, prefetch's guesses); rebuilds the tables when the slots changed."""
        rt = self.runtime
        if rt.observers or rt.replay is not None or rt.prefetch is not None:
            return False
        if self.tier.version != self._version:
            if not self.tier.holds_all():
                return False
            self._refresh()
        return True

    def count(self) -> None:
        """Count one token's experts as GPU hits and its layers as one-call layers (no host saw them)."""
        self.tier.stats.gpu_hits += len(self.layers) * self.top_k
        self.runtime.layer_calls += len(self.layers)

    def compute(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [1,H], top_k_index [1,K], top_k_weights [1,K] -> [1,H], with no host synchronisation."""
        experts, order = torch.sort(top_k_index[0])  # ascending ids: the order the runtime sums in
        weights = top_k_weights[0][order]  # [K]
        buffer = self.tier.buffer

        def views(kind: str) -> SlotTable:
            return SlotTable(buffer, self.tables[(layer, kind)][experts])

        out = self.runtime.plans[layer].experts(hidden, views, experts)  # [K, 1, H]
        total = torch.zeros_like(hidden)
        for i in range(self.top_k):
            total.index_add_(0, self._row, (out[i] * weights[i : i + 1, None]).to(total.dtype))
        return total

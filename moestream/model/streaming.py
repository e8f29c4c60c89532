"""`StreamingExperts`: the parameter-less module that stands in for a transformers experts module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class StreamingExperts(nn.Module):
    """Drop-in for `<Arch>Experts`. Holds no parameters or buffers, so transformers loads no expert
    tensor into it; after loading, `bind` attaches the runtime that streams the experts."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        self.layer_idx: int | None = None
        self.runtime: Any = None

    def bind(self, layer_idx: int, runtime: Any) -> None:
        self.layer_idx, self.runtime = layer_idx, runtime

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        # gpt-oss names the same two arguments router_indices / routing_weights
        index = top_k_index if top_k_index is not None else kwargs["router_indices"]
        weights = top_k_weights if top_k_weights is not None else kwargs["routing_weights"]
        if self.runtime is None:
            raise RuntimeError("StreamingExperts used before moestream bound it to an expert runtime")
        return self.runtime.forward(self.layer_idx, hidden_states, index, weights)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, num_experts={self.num_experts}, streamed"

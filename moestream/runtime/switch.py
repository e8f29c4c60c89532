"""`SwitchLayer`: how one MoE layer's routed experts are computed, chosen once when the runtime picks its
formats (at load), in the shape of mlx-lm's SwitchGLU over QuantizedSwitchLinear.

The family's math is written once (`ExpertFamily.stage`, over a batch of experts) and every format keeps
one batched linear (`WeightFormat.linear_experts`). The runtime asks a layer's `SwitchLayer` for two
things only: every stage of a batch of experts on the same rows (`experts`: a token whose experts are
all held, when `batched`), and one stage of one expert as its bytes land (`stage`, the streaming
schedule). One expert's product is its format's `linear`; a batch's is `linear_experts` (one ggml
compute on the CPU, one grouped launch per matrix kind on the GPU, device slot tables included), which
gives each expert the same bits: so does everything between the products (elementwise), so a layer's
output does not depend on which of the two computed it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moestream.ggml import tiled
from moestream.runtime.families import ExpertFamily, Experts
from moestream.runtime.formats.base import SlotTable, WeightFormat

# kind -> every expert's weight of that kind, in the batch's order (views, or a device slot table)
Views = Callable[[str], "list[Any] | SlotTable"]


class SwitchLayer:
    """One MoE layer's experts on one backend: `family`'s stages over `formats` (kind -> format, fusion
    names included where the tier fuses). `batched`: whether a layer's held experts are worth computing
    as one batch (every format has a kernel that takes several experts: ggml's CPU kernels, the GPU's
    grouped launches; plain torch matrices gain nothing), decided once here."""

    def __init__(
        self,
        layer: int,
        family: ExpertFamily,
        formats: dict[str, WeightFormat],
        stages: list[tuple[str, ...]],
        batched: bool,
    ) -> None:
        self.layer, self.family, self.formats, self.stages = layer, family, formats, stages
        self.batched = batched

    @classmethod
    def choose(
        cls,
        layer: int,
        family: ExpertFamily,
        formats: dict[str, WeightFormat],
        stages: list[tuple[str, ...]],
        device: str,
        under_graphs: bool,
    ) -> SwitchLayer:
        """The layer's plan: batched where every format batches and the family was checked batched on
        `device`; never `under_graphs` (the ggml graphs compute a layer's held experts in their own graph,
        and the runtime computes only the others, one by one as they land)."""
        batched = (
            not under_graphs
            and device in family.batched_on
            and all(fmt.experts_at_once for fmt in formats.values())
        )
        return cls(layer, family, formats, stages, batched)

    def at_once(self, tokens: int, experts: int) -> bool:
        """Whether `experts` held experts of a step of `tokens` rows run as one batch: one token (every
        expert sees the same rows) and more than one expert."""
        return self.batched and tokens == 1 and experts > 1

    def _linear(self, views: Views, apart: bool) -> Callable[[str, torch.Tensor], torch.Tensor]:
        def linear(kind: str, x: torch.Tensor) -> torch.Tensor:  # x [t, in] | [E, t, in] -> [E, t, out]
            fmt, weights = self.formats[kind], views(kind)
            t = x.shape[-2]
            if apart and t >= tiled.TILED_ROWS and fmt.batch_groups():  # a product of each group's rows
                groups = tiled.row_groups(t)
                return torch.cat([_product(fmt, weights, x[..., a : a + n, :]) for a, n in groups], dim=-2)
            return _product(fmt, weights, x)

        return linear

    def stage(
        self,
        kinds: tuple[str, ...],
        x: torch.Tensor,
        carry: torch.Tensor | None,
        views: Views,
        experts: Experts,
        apart: bool = False,
    ) -> torch.Tensor:
        """One stage of the batch `experts` (one expert as its bytes land): x [t, H], carry [E, t, .].
        `apart`: the rows are a batch of sequences, each to get the bits it gets alone (a format whose
        products round otherwise from 8 rows takes them in groups, `WeightFormat.batch_groups`)."""
        return self.family.stage(kinds, x, carry, self._linear(views, apart), self.layer, experts)

    def experts(self, x: torch.Tensor, views: Views, experts: Experts) -> torch.Tensor:
        """Every stage of the batch `experts` on the same rows x [t, H] -> [E, t, H]."""
        carry = None
        for kinds in self.stages:
            carry = self.stage(kinds, x, carry, views, experts)
        return carry


def _product(fmt: WeightFormat, weights: list[Any] | SlotTable, x: torch.Tensor) -> torch.Tensor:
    """x [t, in] | [E, t, in] by each expert's weight -> [E, t, out]."""
    if isinstance(weights, list) and len(weights) == 1:  # one expert: the format's own product
        return fmt.linear(x if x.dim() == 2 else x[0], weights[0]).unsqueeze(0)
    return fmt.linear_experts(x, weights)

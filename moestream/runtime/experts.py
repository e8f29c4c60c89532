"""One MoE layer's routed experts, computed on the CPU as their bytes land in the cache.

Shapes: T tokens, K experts per token, H hidden, I expert intermediate, t tokens routed to one expert.
Schedule per layer forward:
  * every distinct expert is asked of the cache in execution order; cached ones are ready at once
    and so are computed first;
  * each readiness event (expert, kind) arrives exactly once; an expert advances through its stages
    (swiglu: gate -> up -> down; gpt-oss: gate_up -> down) as soon as the kind each stage needs is in,
    so a late expert waits only for its own bytes, never for the rest of the layer;
  * contributions are summed in ascending expert order at the end, so the result does not depend on
    the order reads complete in.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moestream.cache.expert_cache import ExpertCache, LayerJob
from moestream.cache.policy import execution_order
from moestream.runtime.weights import SlotTensors, dequantize_mxfp4


@dataclass
class _Route:
    tokens: torch.Tensor  # [t] token rows of this expert
    positions: torch.Tensor  # [t] its slot in each token's top-k


@dataclass(frozen=True)
class GptOssParams:
    alpha: float
    limit: float


class ExpertRuntime:
    """Computes routed experts for every streamed layer, fed by an `ExpertCache`."""

    def __init__(
        self,
        cache: ExpertCache,
        act_fn: Callable[[torch.Tensor], torch.Tensor] | None,
        *,
        gpt_oss: GptOssParams | None = None,
        biases: dict[tuple[int, str], torch.Tensor] | None = None,
    ) -> None:
        self.cache, self.emap = cache, cache.emap
        self.act_fn, self.gpt_oss, self.biases = act_fn, gpt_oss, biases or {}
        self.kinds = self.emap.kinds
        self._views = SlotTensors()
        self.observers: list[Callable[[int, list[list[int]], torch.Tensor], None]] = []

    def forward(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T,H], top_k_index [T,K], top_k_weights [T,K] -> [T,H] weighted sum of routed experts."""
        rows = top_k_index.tolist()  # the one host readback of the routing
        for observe in self.observers:
            observe(layer, rows, top_k_weights)
        order = execution_order(rows)
        routes = _routes(rows)
        job = self.cache.open_layer(layer, order)
        outputs = self._run(job, hidden, routes, len(order))
        out = torch.zeros_like(hidden)
        for expert in sorted(outputs):
            route = routes[expert]
            weighted = outputs[expert] * top_k_weights[route.tokens, route.positions, None]
            out.index_add_(0, route.tokens, weighted.to(out.dtype))
        return out

    def _run(self, job: LayerJob, hidden: torch.Tensor, routes: dict[int, _Route], count: int) -> dict[int, torch.Tensor]:
        stage = dict.fromkeys(routes, 0)
        ready: dict[int, set[str]] = {e: set() for e in routes}
        carry: dict[int, torch.Tensor] = {}
        error: BaseException | None = None
        remaining = count
        while remaining:
            expert, kind, failure = job.next_event()
            if failure is not None and error is None:
                error = failure
                remaining -= len(job.drop_pending())  # never admitted: nothing in flight to wait for
            ready[expert].add(kind)
            while stage[expert] < len(self.kinds) and self.kinds[stage[expert]] in ready[expert]:
                if error is None:
                    carry[expert] = self._stage(job, expert, stage[expert], hidden, routes[expert], carry.get(expert))
                stage[expert] += 1
            if stage[expert] == len(self.kinds):
                job.release(expert)
                remaining -= 1
        if error is not None:
            raise error
        return carry

    def _stage(self, job: LayerJob, expert: int, index: int, hidden: torch.Tensor, route: _Route, carry: torch.Tensor | None) -> torch.Tensor:
        weight = self._weight(job, expert, self.kinds[index], hidden.dtype)
        if self.gpt_oss is not None:
            return self._gpt_oss_stage(job.layer, expert, index, hidden, route, carry, weight)
        if index == 0:  # gate [I,H]: [t,H] -> [t,I]
            return F.linear(hidden[route.tokens], weight)
        if index == 1:  # up [I,H]: act(gate) * up
            return self.act_fn(carry) * F.linear(hidden[route.tokens], weight)
        return F.linear(carry, weight)  # down [H,I]: [t,I] -> [t,H]

    def _gpt_oss_stage(self, layer: int, expert: int, index: int, hidden: torch.Tensor, route: _Route,
                       carry: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        if index == 0:  # gate_up [H,2I], columns interleaved gate/up
            gate_up = hidden[route.tokens] @ weight + self.biases[(layer, "gate_up_proj_bias")][expert]
            gate = gate_up[..., ::2].clamp(max=self.gpt_oss.limit)
            up = gate_up[..., 1::2].clamp(min=-self.gpt_oss.limit, max=self.gpt_oss.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.gpt_oss.alpha))
        return carry @ weight + self.biases[(layer, "down_proj_bias")][expert]  # down [I,H]

    def _weight(self, job: LayerJob, expert: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        parts = [self._views.view(buf, off, part) for buf, off, part in job.tensor_parts(expert, kind)]
        if self.emap.quant == "mxfp4":
            return dequantize_mxfp4(parts[0], parts[1], dtype).T  # [R,K] -> [K,R] like transformers
        weight = parts[0]
        return weight if weight.dtype == dtype else weight.to(dtype)


def _routes(rows: list[list[int]]) -> dict[int, _Route]:
    tokens: dict[int, list[int]] = {}
    positions: dict[int, list[int]] = {}
    for t, row in enumerate(rows):
        for p, expert in enumerate(row):
            tokens.setdefault(expert, []).append(t)
            positions.setdefault(expert, []).append(p)
    return {e: _Route(torch.tensor(tokens[e]), torch.tensor(positions[e])) for e in tokens}

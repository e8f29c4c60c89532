"""One MoE layer's routed experts, computed as their bytes land in the cache.

Shapes: T tokens, K experts per token, H hidden, I expert intermediate, t tokens routed to one expert.
Schedule per layer forward:
  * every distinct expert is asked of the cache in execution order; cached ones are ready at once
    and so are computed first;
  * each readiness event (expert, kind) arrives exactly once; an expert advances through its stages
    (CPU swiglu: gate -> up -> down; gpt-oss: gate_up -> down) as soon as the kinds a stage needs are
    in, so a late expert waits only for its own bytes, never for the rest of the layer;
  * contributions are summed in ascending expert order at the end, so the result does not depend on
    the order reads complete in.
Subclasses (the CUDA runtime) change where weights come from through `_prepare`, `_weight`, `_finish`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moestream.cache.expert_cache import ExpertCache, LayerJob
from moestream.cache.policy import execution_order
from moestream.runtime.weights import SlotTensors, dequantize_mxfp4


@dataclass
class Route:
    tokens: torch.Tensor  # [t] token rows of this expert
    positions: torch.Tensor  # [t] its slot in each token's top-k
    span: slice  # its rows in the layer's flat routing (`Routing`)
    whole: bool  # every token of the layer, in order (decode: always), so no gather is needed

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T,H] -> [t,H], the rows of the tokens routed here."""
        return hidden if self.whole else hidden[self.tokens]


@dataclass
class Routing:
    """One layer's routing grouped by expert, built from one host tensor (one copy to the device)."""

    tokens: torch.Tensor  # [T*K] token of each (token, expert) pair, grouped by expert
    positions: torch.Tensor  # [T*K]
    by_expert: dict[int, Route]


@dataclass(frozen=True)
class GptOssParams:
    alpha: float
    limit: float


@dataclass
class _Progress:
    """Where one layer forward stands: per expert, its next stage, the kinds in, the running value."""

    stage: dict[int, int]
    ready: dict[int, set[str]]
    carry: dict[int, torch.Tensor] = field(default_factory=dict)
    stalled: list[int] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    error: BaseException | None = None
    remaining: int = 0


class ExpertRuntime:
    """Computes routed experts for every streamed layer, fed by an `ExpertCache` (CPU)."""

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
        self.stages = self._stage_kinds()
        self._views = SlotTensors()
        # called as observe(layer, hidden [T,H], rows (experts per token, router order), weights [T,K])
        self.observers: list[Callable[[int, torch.Tensor, list[list[int]], torch.Tensor], None]] = []
        self._prefetch_routers: dict[
            int, tuple[int, torch.nn.Module]
        ] = {}  # layer -> (next layer, its router)

    def enable_prefetch(self, routers: dict[int, torch.nn.Module]) -> None:
        """Read ahead, while layer L computes, the experts that layer L+1's router picks for L's input
        (the stale gate). `routers` maps every MoE layer to its router module."""
        layers = sorted(routers)
        self._prefetch_routers = {a: (b, routers[b]) for a, b in zip(layers, layers[1:])}

    def _stage_kinds(self) -> list[tuple[str, ...]]:
        """The kinds each compute stage needs, in order."""
        return [(kind,) for kind in self.emap.kinds]

    def forward(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T,H], top_k_index [T,K], top_k_weights [T,K] -> [T,H] weighted sum of routed experts."""
        rows, predicted = self._readback(layer, hidden, top_k_index)
        for observe in self.observers:
            observe(layer, hidden, rows, top_k_weights)
        order = execution_order(rows)
        routing = self._routes(rows, hidden.device)
        outputs = self._compute(layer, order, hidden, routing.by_expert, predicted)
        weights = top_k_weights[routing.tokens, routing.positions]  # [T*K], one gather for the layer
        out = torch.zeros_like(hidden)
        for expert in sorted(outputs):
            route = routing.by_expert[expert]
            weighted = outputs[expert] * weights[route.span, None]
            out.index_add_(0, route.tokens, weighted.to(out.dtype))
        return out

    def _readback(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor
    ) -> tuple[list[list[int]], tuple[int, list[int]] | None]:
        """The routing as lists, and with prefetch on, the next layer's predicted experts, in one readback."""
        ahead = self._prefetch_routers.get(layer)
        if ahead is None:
            return top_k_index.tolist(), None  # the one host readback of the routing
        next_layer, router = ahead
        with torch.no_grad():
            out = router(hidden)
        guess = out[-1] if isinstance(out, tuple) else torch.topk(out, top_k_index.shape[1], dim=-1).indices
        k = top_k_index.shape[1]
        both = torch.cat([top_k_index, guess.to(top_k_index.dtype)], dim=1).tolist()  # still one readback
        return [row[:k] for row in both], (next_layer, execution_order(row[k:] for row in both))

    def _compute(
        self,
        layer: int,
        order: list[int],
        hidden: torch.Tensor,
        routes: dict[int, Route],
        predicted: tuple[int, list[int]] | None = None,
    ) -> dict[int, torch.Tensor]:
        job = self.cache.open_layer(layer, order)
        self._prefetch(predicted)
        return self._run(job, hidden, routes, order)

    def _prefetch(self, predicted: tuple[int, list[int]] | None) -> None:
        if predicted is not None:
            self.cache.prefetch(*predicted)

    def _run(
        self, job: LayerJob, hidden: torch.Tensor, routes: dict[int, Route], experts: list[int]
    ) -> dict[int, torch.Tensor]:
        p = _Progress(
            stage=dict.fromkeys(experts, 0), ready={e: set() for e in experts}, remaining=len(experts)
        )
        while p.remaining:
            expert, kind, failure = job.next_event()
            if failure is not None and p.error is None:
                p.error = failure
                p.remaining -= len(job.drop_pending())  # never admitted: nothing in flight to wait for
            p.ready[expert].add(kind)
            progressed = self._advance(job, expert, hidden, routes, p)
            while progressed and p.stalled:  # a finished expert may have freed what stalled ones wait for
                progressed = False
                for stalled in list(p.stalled):
                    p.stalled.remove(stalled)
                    progressed |= self._advance(job, stalled, hidden, routes, p)
        if p.error is not None:
            raise p.error
        return p.carry

    def _advance(
        self, job: LayerJob, expert: int, hidden: torch.Tensor, routes: dict[int, Route], p: _Progress
    ) -> bool:
        """Run every stage of `expert` whose kinds are in. Returns True when the expert finished."""
        if expert in p.finished or expert in p.stalled:
            return False  # already done, or queued for a retry when a slot frees
        while p.stage[expert] < len(self.stages) and p.ready[expert].issuperset(self.stages[p.stage[expert]]):
            if p.error is None:
                if not self._prepare(job, expert, p.stage[expert]):
                    p.stalled.append(expert)
                    return False
                p.carry[expert] = self._stage(
                    job, expert, p.stage[expert], hidden, routes[expert], p.carry.get(expert)
                )
            p.stage[expert] += 1
        if p.stage[expert] < len(self.stages):
            return False
        p.finished.add(expert)
        self._finish(job, expert, failed=p.error is not None)
        job.release(expert)
        p.remaining -= 1
        return True

    # --- hooks for other devices ---------------------------------------------------------------

    def _prepare(self, job: LayerJob, expert: int, stage: int) -> bool:
        """Make a stage's weights usable; False when it must wait for another expert to finish."""
        return True

    def _finish(self, job: LayerJob, expert: int, failed: bool) -> None:
        """The expert's last stage has been issued."""

    def _routes(self, rows: list[list[int]], device: torch.device) -> Routing:
        """Token and top-k position of every (token, expert) pair, grouped by expert; views, no kernels."""
        groups: dict[int, list[tuple[int, int]]] = {}
        for t, row in enumerate(rows):
            for p, expert in enumerate(row):
                groups.setdefault(expert, []).append((t, p))
        flat_t: list[int] = []
        flat_p: list[int] = []
        spans = {}
        for expert, pairs in groups.items():
            spans[expert] = slice(len(flat_t), len(flat_t) + len(pairs))
            flat_t.extend(t for t, _ in pairs)
            flat_p.extend(p for _, p in pairs)
        both = torch.tensor([flat_t, flat_p], dtype=torch.int64)
        if device.type == "cuda":  # one asynchronous copy (the caching host allocator keeps it alive)
            both = both.pin_memory().to(device, non_blocking=True)
        tokens, positions = both[0], both[1]
        whole = len(rows)
        return Routing(
            tokens,
            positions,
            {
                e: Route(tokens[span], positions[span], span, span.stop - span.start == whole)
                for e, span in spans.items()
            },
        )

    # --- the math ------------------------------------------------------------------------------

    def _stage(
        self,
        job: LayerJob,
        expert: int,
        index: int,
        hidden: torch.Tensor,
        route: Route,
        carry: torch.Tensor | None,
    ) -> torch.Tensor:
        kinds = self.stages[index]
        if self.gpt_oss is not None:
            return self._gpt_oss_stage(
                job.layer,
                expert,
                index,
                hidden,
                route,
                carry,
                self._weight(job, expert, kinds[0], hidden.dtype),
            )
        if kinds == ("gate", "up"):  # fused [2I,H], gate rows first: one matmul, like transformers
            gate, up = F.linear(route.rows(hidden), self._weight(job, expert, "gate_up", hidden.dtype)).chunk(
                2, dim=-1
            )
            return self.act_fn(gate) * up
        weight = self._weight(job, expert, kinds[0], hidden.dtype)
        if kinds == ("gate",):  # gate [I,H]: [t,H] -> [t,I]
            return F.linear(route.rows(hidden), weight)
        if kinds == ("up",):  # up [I,H]: act(gate) * up
            return self.act_fn(carry) * F.linear(route.rows(hidden), weight)
        return F.linear(carry, weight)  # down [H,I]: [t,I] -> [t,H]

    def _gpt_oss_stage(
        self,
        layer: int,
        expert: int,
        index: int,
        hidden: torch.Tensor,
        route: Route,
        carry: torch.Tensor | None,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        if index == 0:  # gate_up [H,2I], columns interleaved gate/up
            gate_up = route.rows(hidden) @ weight + self.biases[(layer, "gate_up_proj_bias")][expert]
            gate = gate_up[..., ::2].clamp(max=self.gpt_oss.limit)
            up = gate_up[..., 1::2].clamp(min=-self.gpt_oss.limit, max=self.gpt_oss.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.gpt_oss.alpha))
        return carry @ weight + self.biases[(layer, "down_proj_bias")][expert]  # down [I,H]

    def _weight(self, job: LayerJob, expert: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        parts = [self._views.view(buf, off, part) for buf, off, part in job.tensor_parts(expert, kind)]
        return self._assemble(parts, dtype)

    def _assemble(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if self.emap.quant == "mxfp4":
            return dequantize_mxfp4(parts[0], parts[1], dtype).T  # [R,K] -> [K,R] like transformers
        weight = parts[0]
        return weight if weight.dtype == dtype else weight.to(dtype)

"""One MoE layer's routed experts, computed as their bytes land, over any device tier.

Shapes: T tokens, K experts per token, H hidden, I expert intermediate, t tokens routed to one expert.
Schedule per layer forward:
  * the routing is read back to the host once (with prefetch on, together with the next layer's
    stale-gate guess);
  * experts the tier holds are computed at once; every other distinct expert is asked of the cache
    in execution order; cached ones are ready at once and so are computed first;
  * each readiness event (expert, kind) arrives exactly once; an expert advances through its family's
    stages as soon as the kinds a stage needs are in, so a late expert waits only for its own bytes,
    never for the rest of the layer;
  * contributions are summed in ascending expert order at the end, so the result does not depend on
    the order reads complete in;
  * whatever raises inside the schedule, every pin and slot of the forward is given back before the
    exception leaves it (reads still running keep their slot until they land), so the next one runs.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moestream.cache.expert_cache import ExpertCache
from moestream.cache.policy import execution_order
from moestream.cache.records import LayerJob
from moestream.runtime.families import ExpertFamily
from moestream.runtime.formats import WeightFormat, layer_formats
from moestream.runtime.prefetch import Guess, PrefetchGate
from moestream.runtime.switch import SwitchLayer
from moestream.runtime.tiers import DeviceTier

EXPERTS_FAILED = "moestream_experts_layer"  # set on an exception raised inside a layer's expert schedule


def raised_in_experts(exc: BaseException) -> bool:
    """Whether `exc` came out of the routed experts' schedule (not out of transformers' own layers)."""
    return hasattr(exc, EXPERTS_FAILED)


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


@dataclass
class Routed:
    """One layer forward's routed experts: the routing used and each expert's output [t, H]."""

    rows: list[list[int]]  # per token, its experts in router order
    weights: torch.Tensor  # [T, K] in the same order
    routing: Routing
    outputs: dict[int, torch.Tensor]

    def weighted_sum(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] sum of each token's experts times their weights, in ascending expert order (so the
        result does not depend on the order reads complete in)."""
        routing = self.routing
        weights = self.weights[routing.tokens, routing.positions]  # [T*K], one gather for the layer
        out = torch.zeros_like(hidden)
        for expert in sorted(self.outputs):
            route = routing.by_expert[expert]
            weighted = self.outputs[expert] * weights[route.span, None]
            out.index_add_(0, route.tokens, weighted.to(out.dtype))
        return out


@dataclass
class LayerRouting:
    """What observers (the trace recorder) see of one layer forward."""

    layer: int
    hidden: torch.Tensor  # [T,H] the experts' input
    rows: list[list[int]]  # per token, its experts in router order
    weights: torch.Tensor  # [T,K]
    ahead: object | None  # the next MoE layer's router applied to `hidden` (the stale gate), when computed


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


def apply_router(router: torch.nn.Module, hidden: torch.Tensor) -> Any:
    """A router module (transformers') on `hidden` [T, H] in the router's own dtype: the ggml graphs hand
    on float32 rows whatever the checkpoint's dtype (a bf16 router on them raised a dtype error)."""
    dtype = next(router.parameters()).dtype
    with torch.no_grad():
        return router(hidden if hidden.dtype == dtype else hidden.to(dtype))


class ExpertRuntime:
    """Computes routed experts for every streamed layer over a `DeviceTier`, fed by an `ExpertCache`."""

    def __init__(
        self, cache: ExpertCache, tier: DeviceTier, family: ExpertFamily, graph_kernels: bool = False
    ) -> None:
        self.cache, self.emap, self.tier, self.family = cache, cache.emap, tier, family
        self.stages = family.stages(fused=tier.fuses and bool(family.fusions))
        self._plan(ggml_floats=graph_kernels)
        if graph_kernels:
            self._graph_kernels()
        self.layer_calls = 0  # forwards whose held experts were computed as one batch
        self.observers: list[Callable[[LayerRouting], None]] = []
        self.prefetch: PrefetchGate | None = None  # reads the next layer's guesses ahead, when it allows
        self._ahead: dict[int, tuple[int, torch.nn.Module]] = {}  # layer -> (next MoE layer, its router)
        self.replay: Any = None  # a `RoutingReplay`: routing and stale-gate guesses from a recorded trace
        self._apart = False  # the forward's rows are a batch of sequences (`experts`)

    def _plan(self, ggml_floats: bool) -> None:
        """Choose the formats of every (layer, kind) and each layer's `SwitchLayer` over them, once."""
        self.formats = self._formats(self.tier.fuses, ggml_floats)
        self.family.bind(self.formats)
        by_layer: dict[int, dict[str, WeightFormat]] = {layer: {} for layer in self.emap.layers}
        for (layer, kind), fmt in self.formats.items():
            by_layer[layer][kind] = fmt
        device = self.tier.device.type
        self.plans = {
            layer: SwitchLayer.choose(layer, self.family, fmts, self.stages, device, ggml_floats)
            for layer, fmts in by_layer.items()
        }

    def _graph_kernels(self) -> None:
        """For the ggml graphs' runner (`graph_kernels`, with the formats planned with ggml floats):
        F32/F16/BF16 experts by ggml too, and every product by ggml_mul_mat_id, the kernel the graphs
        compute a layer's cached experts with; an expert computed here (a miss, or any expert while a
        trace or prefetch needs the routing) gives their bits."""
        from moestream.runtime.formats.ggml import Ggml

        for fmt in self.formats.values():
            if isinstance(fmt, Ggml):
                fmt.by_id = True
        # kinds the cache rewrites once read into the layout ggml reads (gpt-oss's MXFP4 safetensors
        # blocks), rows in the family's order: what the graphs and the stages here both compute from
        repacks = {
            key: fmt.repack(self.family.row_order(*key)) for key, fmt in self.formats.items() if fmt.repacks
        }
        self.cache.repack({key: r for key, r in repacks.items() if r is not None})

    def _formats(self, fuses: bool, ggml_floats: bool) -> dict[tuple[int, str], WeightFormat]:
        formats = layer_formats(self.emap, self.tier.device.type, ggml_floats)
        if fuses:
            for layer in self.emap.layers:
                for name, kinds in self.family.fusions.items():
                    fused = formats[(layer, kinds[0])]
                    for kind in kinds[1:]:
                        fused = fused.fused(formats[(layer, kind)]) if fused is not None else None
                    if fused is None:
                        raise NotImplementedError(
                            f"layer {layer}: {', '.join(kinds)} cannot be computed as one"
                        )
                    formats[(layer, name)] = fused
        return formats

    def set_lookahead(self, routers: dict[int, torch.nn.Module]) -> None:
        """Apply, once per layer forward, layer L+1's router to layer L's input (the stale gate): for
        `prefetch` and for observers. `routers` maps every MoE layer to its router module."""
        layers = sorted(routers)
        self._ahead = {a: (b, routers[b]) for a, b in itertools.pairwise(layers)}

    def forward(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden [T,H], top_k_index [T,K], top_k_weights [T,K] -> [T,H] weighted sum of routed experts."""
        return self.experts(layer, hidden, top_k_index, top_k_weights).weighted_sum(hidden)

    def experts(
        self,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        queued: Callable[[], None] | None = None,
        apart: bool = False,
    ) -> Routed:
        """Every routed expert's output, not yet summed (a caller that sums them itself: the ggml graphs).
        With a routing replay, the routing and weights are the trace's (`Routed.rows`, `.weights`).
        `queued`: the caller heard this layer's routing itself (`heard`; these may be some of its pairs):
        it is not heard again, and `queued` runs once the reads of the layer are queued, instead of the
        read-ahead of `read_ahead`. `apart`: the rows are a batch of sequences, each to get its bits
        alone (`SwitchLayer.stage`)."""
        self._apart = apart
        try:
            if queued is not None:
                return self._route(layer, hidden, top_k_index.tolist(), top_k_weights, queued)
            if self.replay is not None:
                return self._replayed(layer, hidden, top_k_index, top_k_weights)
            rows, predicted = self._hear(layer, hidden, top_k_index, top_k_weights)
            read_ahead = functools.partial(self.read_ahead, predicted)
            return self._route(layer, hidden, rows, top_k_weights, read_ahead)
        finally:
            self._apart = False

    def heard(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> tuple[int, list[int]] | None:
        """A layer's routing worked out without `experts` (a GPU tier's graph; hidden [T,H] and the
        routing [T,K] on the host) heard as `experts` hears it: the gate scores its guess for this layer,
        observers (a trace) record it. Returns the next MoE layer and its confidently guessed experts
        (None without prefetch), for `read_ahead` once the caller's own reads of this layer are queued."""
        return self._hear(layer, hidden, top_k_index, top_k_weights)[1]

    def _hear(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> tuple[list[list[int]], tuple[int, list[int]] | None]:
        """The routing read back (with the next layer's guesses, one readback) and heard (`_heard`): the
        rows, and the next layer's confident guesses."""
        ahead = self._lookahead(layer, hidden)
        rows, guessed = self._readback(layer, top_k_index, ahead)
        return rows, self._heard(layer, hidden, rows, top_k_weights, ahead, guessed)

    def read_ahead(self, predicted: tuple[int, list[int]] | None) -> None:
        """Once per MoE layer forward that `heard` heard (the gate counts them): read `predicted` ahead
        into the cache, behind the reads already queued, where the gate allows it now."""
        go = self.prefetch is not None and self.prefetch.allow()
        if go and predicted is not None:
            self.cache.prefetch(predicted[0], self.tier.missing(*predicted))

    def _replayed(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> Routed:
        """`experts` with the routing (and with prefetch, the stale-gate guess) of a recorded trace."""
        rows, weights, guesses = self.replay.route(
            layer, top_k_index.tolist(), top_k_weights.float().tolist()
        )
        top_k_weights = torch.tensor(weights, dtype=top_k_weights.dtype, device=top_k_weights.device)
        ahead = self._ahead.get(layer)
        guessed = None
        if self.prefetch is not None and ahead is not None and guesses is not None:
            guessed = (ahead[0], guesses)
        predicted = self._heard(layer, hidden, rows, top_k_weights, None, guessed)
        return self._route(layer, hidden, rows, top_k_weights, functools.partial(self.read_ahead, predicted))

    def _heard(
        self,
        layer: int,
        hidden: torch.Tensor,
        rows: list[list[int]],
        top_k_weights: torch.Tensor,
        ahead: tuple[int, object] | None,
        guessed: tuple[int, list[Guess]] | None,
    ) -> tuple[int, list[int]] | None:
        """The routing of `layer` heard: the gate's guess for it scored, then the next layer's guesses
        (`guessed`) given to the gate, which keeps the confident ones (returned); observers told."""
        predicted = None
        if self.prefetch is not None:
            self.prefetch.observe(layer, rows)  # how good the guess for this layer was (before the next)
            if guessed is not None:
                predicted = (guessed[0], self.prefetch.choose(guessed[0], self.emap.num_experts, guessed[1]))
        if self.observers:
            event = LayerRouting(layer, hidden, rows, top_k_weights, ahead[1] if ahead else None)
            for observe in self.observers:
                observe(event)
        return predicted

    def _route(
        self,
        layer: int,
        hidden: torch.Tensor,
        rows: list[list[int]],
        top_k_weights: torch.Tensor,
        queued: Callable[[], None],
    ) -> Routed:
        """The layer's experts once the routing is on the host: `rows` per token, weights [T,K]; `queued`
        run once their reads are queued (the read-ahead)."""
        order = execution_order(rows)
        routing = self._routes(rows, hidden.device)
        outputs = self._compute(layer, order, hidden, routing.by_expert, queued)
        return Routed(rows, top_k_weights, routing, outputs)

    def _lookahead(self, layer: int, hidden: torch.Tensor) -> tuple[int, object] | None:
        """(next MoE layer, its router's output on `hidden`), computed once, when prefetch or an observer
        needs it."""
        ahead = self._ahead.get(layer)
        if ahead is None or not (self.prefetch or self.observers):
            return None
        return ahead[0], apply_router(ahead[1], hidden)

    def _readback(
        self, layer: int, top_k_index: torch.Tensor, ahead: tuple[int, object] | None
    ) -> tuple[list[list[int]], tuple[int, list[Guess]] | None]:
        """The routing as lists, and with prefetch on, the next layer's guesses (each token's top k and
        their scores, for `PrefetchGate.choose`), in one readback."""
        if ahead is None or self.prefetch is None:
            return top_k_index.tolist(), None  # the one host readback of the routing
        next_layer, out = ahead
        k = top_k_index.shape[1]
        scores = torch.softmax((out[0] if isinstance(out, tuple) else out).float(), dim=-1)  # [T, E]
        confidence, guess = torch.topk(scores, k, dim=-1)  # [T, k] each
        # one readback of routing, guesses and their scores (expert ids are exact in float32)
        both = torch.cat([top_k_index.float(), guess.float(), confidence], dim=1).tolist()
        rows = [[int(e) for e in row[:k]] for row in both]
        guesses = [list(zip(map(int, row[k : 2 * k]), row[2 * k :])) for row in both]
        return rows, (next_layer, guesses)

    def _compute(
        self,
        layer: int,
        order: list[int],
        hidden: torch.Tensor,
        routes: dict[int, Route],
        queued: Callable[[], None],
    ) -> dict[int, torch.Tensor]:
        job = None
        try:
            uses = [routes[e].span.stop - routes[e].span.start for e in order]  # tokens routed to each
            self.tier.begin_group(layer, order, uses, hidden.shape[0])
            ready, rest = self.tier.split(layer, order)
            outputs = self._held(layer, ready, hidden, routes)
            if rest:
                served = dict(zip(order, uses))
                job = self.cache.open_layer(layer, rest, [served[e] for e in rest], hidden.shape[0])
            queued()  # the read-ahead, behind the layer's reads
            if job is not None:
                at_once = self.tier.in_place and self.plans[layer].at_once(hidden.shape[0], len(rest))
                if at_once and not job.misses:
                    self._at_once(job, hidden, rest, outputs)
                else:
                    outputs.update(self._run(job, hidden, routes, rest))
        except BaseException as exc:  # a bad tensor, a bug, KeyboardInterrupt: the next forward must run
            self._abandon(layer, job)
            if not raised_in_experts(exc):
                setattr(exc, EXPERTS_FAILED, layer)
                exc.add_note(f"raised while computing the routed experts of layer {layer}")
            raise
        return outputs

    def _held(
        self, layer: int, experts: list[int], hidden: torch.Tensor, routes: dict[int, Route]
    ) -> dict[int, torch.Tensor]:
        """The experts the tier holds (GPU slots): as one batch where the layer's plan says so, else each
        through its stages."""
        if not self.plans[layer].at_once(hidden.shape[0], len(experts)):
            return {expert: self._resident(layer, expert, hidden, routes[expert]) for expert in experts}
        out = self._batch(layer, experts, hidden, None)
        for expert in experts:
            self.tier.release(layer, expert, None, failed=False)
        return out

    def _at_once(
        self,
        job: LayerJob,
        hidden: torch.Tensor,
        experts: list[int],
        outputs: dict[int, torch.Tensor],
    ) -> None:
        """Every expert of one token held by the cache, as one batch (the same kernels as the stages, so
        the same bits)."""
        outputs.update(self._batch(job.layer, experts, hidden, job))
        for expert in experts:
            self.tier.release(job.layer, expert, job, failed=False)
            job.release(expert)

    def _batch(
        self, layer: int, experts: list[int], hidden: torch.Tensor, job: LayerJob | None
    ) -> dict[int, torch.Tensor]:
        """One token's `experts` as one batch (every expert sees the token's row)."""
        out = self.plans[layer].experts(hidden, self._views(layer, experts, job), experts)  # [E, 1, H]
        self.layer_calls += 1
        return {expert: out[i] for i, expert in enumerate(experts)}

    def _abandon(self, layer: int, job: LayerJob | None) -> None:
        """Give back every pin and slot this forward holds, in the tier and in the host cache."""
        try:
            self.tier.abort(layer)
        finally:
            if job is not None:
                self.cache.abandon(job)

    def _resident(self, layer: int, expert: int, hidden: torch.Tensor, route: Route) -> torch.Tensor:
        """An expert the tier holds: every stage at once."""
        carry = None
        for kinds in self.stages:
            carry = self._stage(layer, expert, kinds, hidden, route, carry, None)
        self.tier.release(layer, expert, None, failed=False)
        return carry

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
            kinds = self.stages[p.stage[expert]]
            if p.error is None:
                if not self.tier.prepare(job, expert, kinds):
                    p.stalled.append(expert)
                    return False
                p.carry[expert] = self._stage(
                    job.layer, expert, kinds, hidden, routes[expert], p.carry.get(expert), job
                )
            p.stage[expert] += 1
        if p.stage[expert] < len(self.stages):
            return False
        p.finished.add(expert)
        self.tier.release(job.layer, expert, job, failed=p.error is not None)
        job.release(expert)
        p.remaining -= 1
        return True

    def _stage(
        self,
        layer: int,
        expert: int,
        kinds: tuple[str, ...],
        hidden: torch.Tensor,
        route: Route,
        carry: torch.Tensor | None,
        job: LayerJob | None,
    ) -> torch.Tensor:
        batch = None if carry is None else carry.unsqueeze(0)  # [t, .] -> a batch of one [1, t, .]
        views = self._views(layer, [expert], job)
        return self.plans[layer].stage(kinds, route.rows(hidden), batch, views, [expert], self._apart)[0]

    def _views(self, layer: int, experts: list[int], job: LayerJob | None) -> Callable[[str], list[Any]]:
        """kind (a fusion name where the tier fuses) -> each of `experts`' weight of that kind, zero-copy
        over the bytes the tier holds."""

        def views(kind: str) -> list[Any]:
            fmt = self.formats[(layer, kind)]
            return [fmt.view(self.tier.raws(layer, e, kind, job)) for e in experts]

        return views

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

"""Recording router traces while generating: one row per (request, token, phase, MoE layer).

Optionally with the stale-gate prediction of the seed's mechanism 3: layer L+1's (and L+2's) router
applied to layer L's router input, top-2k experts with their softmax scores.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from moestream.cache.slots import slot_bytes as slot_size
from moestream.model.loader import router_modules
from moestream.runtime.experts import LayerRouting, apply_router
from moestream.trace import TraceError, TraceHeader, TraceWriter


class TraceRecorder:
    """Receives every streamed layer's routing from the runtime and appends it to a trace file.

    The stale-gate prediction for L+1 is the runtime's own (computed once per layer, shared with
    prefetch); L+2's router is applied here.
    """

    def __init__(self, engine: Any, path: str | Path, predict: bool = True, flush_rows: int = 4096) -> None:
        self.writer = TraceWriter(path, _header(engine), flush_rows=flush_rows)
        self.error: TraceError | None = None  # the write that failed; recording stopped there
        self.top_k = engine.top_k
        self.predict = predict
        self.routers = router_modules(engine.model) if predict else {}
        self.request, self.phase, self.first_position, self.step = "", "prefill", 0, 0
        # a batched forward's rows (`forward_rows`): (request, token, phase) each, else None
        self.rows: list[tuple[str, int, str]] | None = None
        self._lock = threading.Lock()  # rows come from the round's thread, flushes from each request's
        self.attach(engine)

    def attach(self, engine: Any) -> None:
        """Observe `engine`'s (current) runtime."""
        if self.predict:
            engine.streaming.enable_lookahead(self.routers)
        engine.runtime.observers.append(self.observe)

    def detach(self, runtime: Any) -> None:
        runtime.observers.remove(self.observe)

    def forward(self, request: str, phase: str, first_position: int) -> None:
        """Called before each model forward: which request, phase and token positions it covers."""
        self.request, self.phase, self.first_position = request, phase, first_position
        self.rows = None
        self.step += 1

    def forward_rows(self, rows: list[tuple[str, int, str]]) -> None:
        """Called before a forward of several requests' tokens (`--parallel`): each row's (request,
        token, phase), in the forward's row order; the rows share one step."""
        self.rows = rows
        self.step += 1

    def context(self) -> tuple:
        """The forward the next rows belong to (`forward`, `forward_rows`), for `resume`."""
        return self.request, self.phase, self.first_position, self.rows, self.step

    def resume(self, context: tuple) -> None:
        """The next rows belong to the forward `context` names (a round's steps side by side: their
        layers come in turn, `GgmlRunner.together`)."""
        self.request, self.phase, self.first_position, self.rows, self.step = context

    @torch.inference_mode()
    def observe(self, event: LayerRouting) -> None:
        if self.error is not None:
            return  # a failed trace (a full disk) must not stop the generation; close() reports it
        try:
            with self._lock:
                self._append(event)
        except TraceError as exc:
            self.error = exc

    def _append(self, event: LayerRouting) -> None:
        layer, rows = event.layer, event.rows
        tokens = range(self.first_position, self.first_position + len(rows))
        extra: dict[str, Any] = {}
        if self.predict:
            for out, prefix in ((event.ahead, "pred"), (self._apply(layer + 2, event.hidden), "pred2")):
                if out is not None:
                    extra[f"{prefix}_experts"], extra[f"{prefix}_scores"] = self._predict(out)
        weights = event.weights.float().tolist()
        if self.rows is None:
            self.writer.append_forward(
                self.request, list(tokens), self.phase, layer, rows, weights, step=self.step, **extra
            )
            return
        for i, (request, token, phase) in enumerate(self.rows):  # a row each: its own request
            mine = {name: value[i : i + 1] for name, value in extra.items()}
            self.writer.append_forward(
                request, [token], phase, layer, rows[i : i + 1], weights[i : i + 1], step=self.step, **mine
            )

    def _apply(self, layer: int, hidden: torch.Tensor) -> Any:
        router = self.routers.get(layer)
        return None if router is None else apply_router(router, hidden)

    def _predict(self, out: Any) -> tuple[list, list]:
        logits = out if isinstance(out, torch.Tensor) else out[0]  # routers return (logits, weights, indices)
        scores = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(scores, min(2 * self.top_k, scores.shape[-1]), dim=-1)
        return top.indices.tolist(), top.values.tolist()

    def flush(self) -> None:
        """Hand the rows recorded so far to the kernel (a failure is kept for close(), as in observe)."""
        if self.error is None:
            try:
                with self._lock:
                    self.writer.flush()
            except TraceError as exc:
                self.error = exc

    def close(self) -> None:
        """Finish the file. Raises TraceError when recording failed (now or during the run)."""
        self.writer.close()


def _header(engine: Any) -> TraceHeader:
    emap, config = engine.emap, engine.config
    n_layers = int(getattr(config, "num_hidden_layers", None) or config.get_text_config().num_hidden_layers)
    per_layer_unit, per_layer_slot = {}, {}
    for (layer, expert), parts in emap.units.items():
        per_layer_unit[layer] = max(per_layer_unit.get(layer, 0), emap.unit_bytes(layer, expert))
        per_layer_slot[layer] = max(per_layer_slot.get(layer, 0), slot_size(parts))
    first = min(per_layer_unit)
    dtype = "+".join(emap.format_names()).lower()
    return TraceHeader(
        model_id=str(engine.path),
        n_layers=n_layers,
        n_experts=emap.num_experts,
        top_k=engine.top_k,
        dtype=dtype,
        # dense layers get the first MoE layer's size: the lists are indexed by layer and never read there
        expert_bytes=[per_layer_unit.get(i, per_layer_unit[first]) for i in range(n_layers)],
        slot_bytes=[per_layer_slot.get(i, per_layer_slot[first]) for i in range(n_layers)],
        synthetic=engine.source.synthetic,
        source="moestream recorder",
    )
